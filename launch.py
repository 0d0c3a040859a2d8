"""`python launch.py <overrides>` from a checkout: the same as the `speedllm` console script (speedllm/cli.py).

    python launch.py model=qwen3_0.6b parallel=tp8
    python launch.py -m model=qwen3_tiny optim.lr=1e-4,3e-4
"""

from speedllm.cli import main

if __name__ == "__main__":
    main()
