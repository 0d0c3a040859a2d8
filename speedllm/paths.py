"""Where SpeedLLM's own files are: the config tree and the bundled assets ship inside the package."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CONF = PACKAGE / "conf"  # Hydra's config tree (conf/config.yaml and one folder per group)
ASSETS = PACKAGE / "assets"  # bundled corpus, tokenizers and SFT demo set (tools/ rebuilds them)
ROOT = PACKAGE.parent  # the repository checkout (launch.py, tests/, benchmarks/); site-packages when installed
