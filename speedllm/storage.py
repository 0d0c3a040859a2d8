"""Files by local path or by URL: the one module that knows about storage protocols.

A local path stays a `pathlib.Path` and goes through the ordinary file functions, so local runs behave exactly as
they always did. A URL (`s3://bucket/run`, `gs://...`, `file:///...`, `memory://...`) goes through fsspec; its
protocol's package is an extra (`pip install 'speedllm[s3]'` brings s3fs). Credentials and endpoints are not our settings:
the protocol's package reads them from the environment or its usual config (for S3: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY or ~/.aws, AWS_ENDPOINT_URL for an S3-compatible store). Object stores have no rename, so
what must appear whole is written as one object (`write_text`), and a run marks what it finished by writing a
pointer last.

Credentials may also be written into a URL (`s3://KEY:SECRET@bucket/run`, `https://user:password@host/...`); they
never reach a log, an error line or a saved config: at launch the config holds the URL masked
(`s3://***@bucket/run`, `shown`) and the credentials live only in the environment of the run's processes
(CREDENTIALS_ENV), from which `filesystem` puts them back (for s3://, as s3fs's key and secret); `scrub` masks them
in any text printed.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import urllib.parse
from pathlib import Path
from typing import Iterator, List, Union

from speedllm.errors import UserError, one_line

Location = Union[str, Path]

# protocol -> the extra that installs its fsspec implementation (the others: fsspec's known_implementations name it)
EXTRAS = {"s3": "s3", "s3a": "s3"}
S3 = ("s3", "s3a")
CREDENTIALS_ENV = "SPEEDLLM_URL_CREDENTIALS"  # {"<protocol>://<host>": "<userinfo>"} of the URLs the config masks
MASK = "***"
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^/\s@'\"]+)@")
QUICK_S = 3  # seconds a call made before launch waits for a silent server to connect, and then to answer


def shown(url: Location) -> str:
    """`url` as humans may see it: its userinfo (credentials) masked, `s3://***@bucket/run`."""
    return _USERINFO.sub(rf"\1{MASK}@", str(url))


def _credentials() -> dict:
    return json.loads(os.environ.get(CREDENTIALS_ENV) or "{}")


def _secrets() -> list:
    """The credentials of this run, as given and decoded, and their parts (user, password) of 4+ characters."""
    found = set()
    for userinfo in _credentials().values():
        for text in (userinfo, urllib.parse.unquote(userinfo)):
            found.update([text, *(part for part in text.split(":") if len(part) >= 4)])
    return sorted(found, key=len, reverse=True)


def scrub(text: str) -> str:
    """`text` with every URL's userinfo and every credential of this run masked (for a line printed or logged)."""
    text = shown(text)
    for secret in _secrets():
        text = text.replace(secret, MASK)
    return text


def hide_credentials(url: str) -> str:
    """A URL with credentials: them kept in this process' environment (inherited by its ranks), the URL masked."""
    match = _USERINFO.match(url)
    if match is None or match.group(2) == MASK:
        return url
    host = url[match.end():].split("/", 1)[0]
    known = _credentials()
    known[f"{match.group(1)}{host}"] = match.group(2)
    os.environ[CREDENTIALS_ENV] = json.dumps(known)
    return shown(url)


def fsspec_target(url: Location) -> tuple:
    """(URL, storage options) to hand fsspec for `url`: a masked URL's credentials put back from the environment
    (for s3://, s3fs's key and secret: it reads none from a URL)."""
    url = str(url)
    match = _USERINFO.match(url)
    if match is None:
        return url, {}
    rest = url[match.end():]
    userinfo = match.group(2)
    if userinfo == MASK:
        userinfo = _credentials().get(f"{match.group(1)}{rest.split('/', 1)[0]}")
        if userinfo is None:
            raise UserError(f"{url}: the credentials of this URL are not known to this process; give the URL with "
                            f"them again, or the credentials the way the protocol's package reads them")
    if match.group(1).rstrip(":/") in S3:
        user, _, password = (urllib.parse.unquote(x) for x in userinfo.partition(":"))
        return match.group(1) + rest, {"key": user, "secret": password}
    return f"{match.group(1)}{userinfo}@{rest}", {}


def write_text_atomic(path: Path, text: str, key: str) -> None:
    """Write `path` under a temporary name, flushed to disk, and rename it, so a reader never sees half a file.

    A device or pipe (/dev/stdout) is written in place: renaming over it would replace the device. A failed
    write (a full disk) is the user's one-line error naming `key`, and leaves no file behind.
    """
    if path.exists() and not path.is_file():
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise UserError(f"{key}={path}: writing failed ({e.strerror or e}); choose another {key}") from None
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"{key}={path}: writing failed ({e.strerror or e}); free space there or choose another "
                        f"{key}") from None
    finally:
        tmp.unlink(missing_ok=True)


def is_url(path: Location) -> bool:
    return "://" in str(path)


def location(path: Location) -> Location:
    """A local path as a Path (as before), a URL as its string (pathlib would fold its '//')."""
    return str(path).rstrip("/") if is_url(path) else Path(path)


def absolute(path: Location) -> Location:
    return location(path) if is_url(path) else Path(path).absolute()


def join(base: Location, *names: str) -> Location:
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *names])
    return Path(base).joinpath(*names)


def name(path: Location) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1] if is_url(path) else Path(path).name


def filesystem(url: str, key: str = "path", quick: bool = False):
    """(fsspec filesystem, path inside it) of `url`; an unknown protocol, a missing package or a server that
    cannot be reached is one line. `quick`: a call before launch, which waits seconds for a silent server."""
    import fsspec

    protocol = str(url).split("://", 1)[0]
    target, options = fsspec_target(url)
    if quick and protocol in S3:  # AWS_MAX_ATTEMPTS tries (botocore's variable), 2 where it is not set
        attempts = int(os.environ.get("AWS_MAX_ATTEMPTS") or 2)
        options = {**options, "config_kwargs": {"connect_timeout": QUICK_S, "read_timeout": QUICK_S,
                                                "retries": {"total_max_attempts": attempts}}}
    try:
        fs, path = fsspec.core.url_to_fs(target, **options)
        if quick and protocol in S3:
            fs.retries = 1  # s3fs's own retries on top of botocore's: none before launch (its instance alone)
        return fs, path
    except ValueError:
        raise UserError(f"{key}={shown(url)}: unknown storage protocol '{protocol}://'; use a local path or an fsspec "
                        f"URL (s3://, gs://, file://, memory:// ...)") from None
    except ImportError as e:
        extra = EXTRAS.get(protocol)
        how = f"pip install 'speedllm[{extra}]'" if extra else "install fsspec's package for that protocol"
        raise UserError(f"{key}={shown(url)} needs the '{protocol}://' storage package, which is not installed "
                        f"({e.name or e}); {how}") from None
    except OSError as e:  # a protocol that connects when the filesystem is made (ftp://, sftp://)
        raise UserError(f"{key}={shown(url)}: the storage could not be reached ({scrub(one_line(e))}); check the "
                        "host and that it is up") from None


def _fs(url: str):
    fs, path = filesystem(url)
    fs.invalidate_cache()  # another process may have written since this one last listed
    return fs, path


def exists(path: Location) -> bool:
    if not is_url(path):
        return Path(path).exists()
    fs, p = _fs(path)
    return fs.exists(p)


def is_file(path: Location) -> bool:
    if not is_url(path):
        return Path(path).is_file()
    fs, p = _fs(path)
    return fs.isfile(p)


def glob(pattern: Location) -> List[str]:
    """The files `pattern` matches, sorted, as paths or URLs of the same kind."""
    if not is_url(pattern):
        import glob as globbing

        return sorted(globbing.glob(str(pattern), recursive=True))
    fs, p = _fs(pattern)
    return sorted(fs.unstrip_protocol(m) for m in fs.glob(p))


def open_file(path: Location, mode: str = "rb"):
    if not is_url(path):
        return open(path, mode)
    fs, p = filesystem(path)
    return fs.open(p, mode)


def read_text(path: Location) -> str:
    with open_file(path, "r") as f:
        return f.read()


def write_text(path: Location, text: str, key: str) -> None:
    """The whole file at once: a local one under a temporary name then renamed, a remote one as one object."""
    if not is_url(path):
        return write_text_atomic(Path(path), text, key)
    fs, p = filesystem(path)
    fs.pipe_file(p, text.encode())


def put(local: Path, url: str) -> None:
    """Upload local file `local` to `url`."""
    fs, p = filesystem(url)
    fs.put_file(str(local), p)


def list_names(directory: Location) -> List[str]:
    """The names of the entries directly inside `directory` (none when it does not exist)."""
    if not is_url(directory):
        return sorted(p.name for p in Path(directory).iterdir()) if Path(directory).is_dir() else []
    fs, p = _fs(directory)
    return sorted(name(e) for e in fs.ls(p, detail=False)) if fs.exists(p) else []


def remove(path: Location) -> None:
    """Delete a directory (or prefix) and everything under it."""
    if not is_url(path):
        return shutil.rmtree(path)
    fs, p = filesystem(path)
    fs.rm(p, recursive=True)


def cached_files(urls: List[str], cache_dir: Location) -> List[Path]:
    """Local copies of the remote files `urls`, side by side in one folder of `cache_dir` named after them and
    their versions (fsspec's ukey: size and ETag or mtime), so each version is downloaded once. Each file is
    downloaded under a temporary name and renamed: concurrent processes may share the cache."""
    versions = []
    for url in urls:
        fs, p = _fs(url)
        versions.append(f"{url}\n{fs.ukey(p)}")
    folder = Path(str(cache_dir)) / "remote" / hashlib.sha256("\n".join(versions).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    copies = []
    for url in urls:
        local = folder / name(url)
        if not local.is_file():
            tmp = local.with_name(f".{local.name}.tmp{os.getpid()}")
            fs, p = filesystem(url)
            fs.get_file(p, str(tmp))
            os.replace(tmp, local)
        copies.append(local)
    return copies


def cached_dir(url: str, cache_dir: Location) -> Path:
    """A local copy of the files directly inside the remote directory `url` (see cached_files)."""
    files = [m for m in glob(join(url, "*")) if is_file(m)]
    if not files:
        raise UserError(f"{url} holds no files; point it at a directory (prefix) with the model's files")
    return cached_files(files, cache_dir)[0].parent


def cached_prefix(prefix: str, suffixes, cache_dir: Location) -> str:
    """The local prefix of copies of the remote files `prefix + suffix` that exist (see cached_files)."""
    urls = [prefix + suffix for suffix in suffixes if is_file(prefix + suffix)]
    return str(cached_files(urls, cache_dir)[0].parent / name(prefix))


def local_inputs(patterns, cache_dir: Location) -> list:
    """Files or globs, with each URL among them replaced by local copies of the files it matches, in order."""
    found = []
    for pattern in [patterns] if isinstance(patterns, str) else list(patterns):
        matched = glob(pattern) if is_url(pattern) else []
        found.extend([str(p) for p in cached_files(matched, cache_dir)] if matched else [pattern])
    return found


@contextlib.contextmanager
def local_output(target: str, scratch: Location) -> Iterator[str]:
    """Where to write `target` (a file prefix or a directory): itself when local; for a URL a fresh local path
    under `scratch`, whose files (every path that starts with it) are uploaded to the URL once the block ends
    without an error, then removed."""
    if not is_url(target):
        yield target
        return
    filesystem(target, "output")
    folder = Path(tempfile.mkdtemp(prefix="upload-", dir=_made(scratch)))
    local = folder / name(target)
    try:
        yield str(local)
        fs, p = filesystem(target)
        # a prefix's files (.bin, .idx, then .json) or the one directory; not the scratch files beside them
        for made in sorted(entry for entry in folder.iterdir() if entry.name.startswith(local.name)):
            suffix = made.name[len(local.name):]
            if made.is_dir():
                fs.put(str(made), p + suffix, recursive=True)
            else:
                fs.put_file(str(made), p + suffix)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _made(folder: Location) -> str:
    Path(str(folder)).mkdir(parents=True, exist_ok=True)
    return str(folder)


def check(key: str, url: str, must_exist: bool, probe: bool = False) -> None:
    """Before any rank starts: `url`'s protocol is known and installed, its bucket (or root) is there, the
    credentials are accepted, with `must_exist` the object (or prefix, or glob) itself is there, and with `probe` a
    small object can be written there and deleted (what the first save would meet). A server that accepts the
    connection but does not answer fails within seconds (QUICK_S per attempt), naming the URL."""
    fs, p = filesystem(url, key, quick=True)
    bucket = p.split("/", 1)[0] if p and not p.startswith("/") else None
    try:
        fs.invalidate_cache()
        if bucket is not None:
            try:
                fs.ls(bucket, detail=False)  # raises what exists() hides: no credentials, access refused
            except FileNotFoundError:
                raise UserError(f"{key}={shown(url)}: bucket '{bucket}' does not exist; create it or choose "
                                "another") from None
        if must_exist and not (fs.exists(p) or fs.glob(p)):
            raise UserError(f"{key}={shown(url)} does not exist; check the URL")
        if probe:
            marker = f"{p.rstrip('/')}/.speedllm-probe-{os.getpid()}"
            fs.pipe_file(marker, b"")
            fs.rm(marker)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the protocol's own error (no credentials, refused, unreachable)
        raise UserError(f"{key}={shown(url)}: the storage refused or could not be reached ({scrub(one_line(e))}); "
                        "give credentials and endpoint the way the protocol's package reads them (for s3://: "
                        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or ~/.aws, AWS_ENDPOINT_URL for an "
                        "S3-compatible store)") from None
