"""The request bodies task=serve accepts, as pydantic models: every field checked by type and range at the edge.

Strict types (a `stream` of "yes" or 1 is refused, not read as true; `seed: "5"` is not an integer), no NaN or
infinity, integers that must fit in 64 bits, and no unknown fields: a parameter this server does not implement is
refused (OpenAI's own answer to an unknown one), never silently ignored. What depends on the served model (its
name, vocabulary, context length, serve.max_queue) is checked by the server once the body has parsed.
"""

from typing import Annotated, List, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from speedllm.generation.sampling import MIN_TEMPERATURE

MAX_STOPS = 4  # OpenAI's limit on stop strings


def one_of(description: str) -> WrapValidator:
    """A union's error as one line naming what is accepted (pydantic reports every branch's failure)."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", f"must be {description}") from None

    return WrapValidator(check)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[Union[str, List[TextPart]], one_of('a string or a list of {"type": "text", "text": …} parts')]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatTemplateKwargs(Strict):
    enable_thinking: Optional[bool] = None  # Qwen3's thinking switch (vLLM's name); None: generate.enable_thinking


class StreamOptions(Strict):
    include_usage: bool = False


Stop = Annotated[Union[str, Annotated[List[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOPS)]],
                 one_of(f"a string or a list of at most {MAX_STOPS} non-empty strings")]


def not_tiny(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise PydanticCustomError("invalid_value", f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return value


class Sampled(Strict):
    """What a chat and a completion request share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Annotated[float, Field(ge=0, le=2), AfterValidator(not_tiny)] = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    n: int = Field(1, ge=1)
    seed: Optional[int] = Field(None, ge=-2**63, le=2**63 - 1)
    stop: Optional[Stop] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # the caller's end-user id: OpenAI keeps it for abuse monitoring; nothing to do here

    @property
    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampled):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name of max_tokens
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None


Prompt = Union[Annotated[str, Field(min_length=1)], Annotated[List[str], Field(min_length=1, max_length=1)],
               Annotated[List[int], Field(min_length=1)]]


class CompletionRequest(Sampled):
    prompt: Annotated[Prompt, one_of("a non-empty string, a list of one string, or a non-empty list of token ids")]
