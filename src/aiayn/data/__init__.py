"""The data path, from archives on the internet to the batches a training step takes.

    download -> prepare -> bindata -> batching -> corpus

- `download`  `aiayn download`: Multi30k (`text`) or WMT14 (`wmt14`) into the cache, sha256-checked;
- `text`      aligned text files in (plain or .gz, strict UTF-8, one-line errors), Multi30k's files,
              and `collate`, which pads one batch of id lists to its own longest sentence;
- `wmt14`     the paper's corpus: archives unpacked into aligned text, newstest from its SGML;
- `prepare`   `aiayn prepare`: text -> SentencePiece on a sample -> memory-mapped token arrays;
- `bindata`   that format on disk (flat tokens, offsets, lengths, manifest) and its reader;
- `batching`  token buckets cut from the length arrays (numpy), each rank's share of a step;
- `corpus`    what `aiayn train` opens: `--data-bin`, or raw text prepared into the run first;
- `lock`      one data folder shared by several machines (wmt14 and prepare take turns on it).

Data flows down this list; imports follow the layers (text, wmt14 < download, bindata < prepare <
corpus; batching stands alone), and nothing here imports train or the CLI.
"""
