"""``python -m train.data.prepare INPUT... --tokenizer PATH --out DIR``: text -> token files.

Inputs: plain text files (one document each), JSONL (one document per line, its ``text``
field or ``--field``) and Parquet (the same column; needs ``pyarrow``); a directory
stands for the files under it. The tokenizer is the user's: a ``tokenizer.json`` or a
Hugging Face model directory that holds one (``tokenizers``, Rust, encodes each batch
on every core). ``--train-tokenizer N`` trains a byte-level BPE of N tokens on the
inputs instead (seconds; the offline demo's way).

Every document ends with the tokenizer's EOS. Documents are split train/val by a seeded
hash of their index (``--val-fraction``), so the split does not depend on batching or
on the number of cores. Written: ``train.bin`` and ``val.bin`` (flat token ids, uint16
when the vocabulary fits, else uint32), the tokenizer files, and ``manifest.json``
(tokenizer and its sha256, vocab size, EOS/BOS ids, dtype, document and token counts per
split). ``data.source=tokens data.path=DIR`` trains on it.

``--chat``: JSONL conversations (``messages``) rendered with the tokenizer's chat
template, with a loss mask and conversation offsets beside the tokens
(:mod:`train.data.chat_prepare`); ``data.source=chat data.path=DIR`` trains on it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from spec.data import MANIFEST, TRAIN_BIN, VAL_BIN

EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
BATCH_CHARS = 4 << 20  # text per encode_batch call
# Files of a directory input that are not text.
SKIPPED = {".pyc", ".so", ".bin", ".pt", ".safetensors", ".npy", ".gz", ".zip", ".png", ".jpg"}


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path, help="text, .jsonl or .parquet files, or directories")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json, or a Hugging Face model directory")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB tokens on the inputs instead of --tokenizer")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--field", default="text", help="the text field of JSONL records / Parquet rows")
    p.add_argument("--val-fraction", type=float, default=0.05, help="documents held out for validation")
    p.add_argument("--eos", help="the end-of-document token (default: the tokenizer's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    p.add_argument("--no-progress", action="store_true")
    chat = p.add_argument_group("chat data (--chat)")
    chat.add_argument("--chat", action="store_true",
                      help="inputs are JSONL conversations ({\"messages\": [{\"role\", \"content\"}, ...]}) "
                      "rendered with the tokenizer's chat template")
    chat.add_argument("--loss-on", default="assistant",
                      help="assistant (default): loss on the assistant turns only; all: on every token")
    chat.add_argument("--max-length", type=int, default=0, metavar="TOKENS",
                      help="longest conversation kept, in tokens (0: no limit); see --overlong")
    chat.add_argument("--overlong", default="truncate",
                      help="a conversation over --max-length: truncate (default: cut to it) or drop (leave it out)")
    chat.add_argument("--chat-template", type=Path, metavar="FILE",
                      help="a Jinja chat template in place of the tokenizer's (as TRL's chat_template_path; "
                      "written to the output as chat_template.jinja, so an export renders the same)")
    args = p.parse_args(argv)
    if args.chat and args.loss_on not in ("assistant", "all"):
        p.error(f"--loss-on={args.loss_on} is unknown; use assistant or all")
    if args.chat and args.overlong not in ("truncate", "drop"):
        p.error(f"--overlong={args.overlong} is unknown; use truncate or drop")
    if args.chat_template is not None and not args.chat:
        p.error(f"--chat-template {args.chat_template} renders conversations: add --chat")
    if not args.chat and (args.max_length or args.overlong != "truncate"):
        p.error("--max-length and --overlong are for chat data; add --chat (text documents are not cut)")
    if args.max_length < 0:
        p.error(f"--max-length={args.max_length} must be >= 0 (0: no limit)")
    if args.chat and args.train_tokenizer is not None:
        p.error("--chat needs the chat model's --tokenizer (its chat template); --train-tokenizer has none")
    if (args.tokenizer is None) == (args.train_tokenizer is None):
        p.error("give one of --tokenizer PATH and --train-tokenizer VOCAB")
    if not 0 <= args.val_fraction < 1:
        p.error(f"--val-fraction={args.val_fraction} must be in [0, 1)")
    return args


def input_files(inputs: Iterable[Path]) -> List[Path]:
    files: List[Path] = []
    for path in inputs:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                            and p.suffix.lower() not in SKIPPED and "__pycache__" not in p.parts)
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"error: input {path} does not exist")
    return files


def documents(files: List[Path], field: str) -> Iterator[str]:
    """Every document of ``files`` in order."""
    for f in files:
        suffix = f.suffix.lower()
        if suffix in (".jsonl", ".json", ".ndjson"):
            with open(f, encoding="utf-8") as lines:
                for n, line in enumerate(lines, 1):
                    if line.strip():
                        record = json.loads(line)
                        if field not in record:
                            raise SystemExit(f"error: {f}:{n} has no field {field!r}; name it with --field")
                        yield record[field]
        elif suffix == ".parquet":
            yield from _parquet(f, field)
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def _parquet(f: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"error: {f} is Parquet, which needs pyarrow: pip install pyarrow") from None
    table = pq.ParquetFile(f)
    if field not in table.schema_arrow.names:
        raise SystemExit(f"error: {f} has no column {field!r} (columns: {table.schema_arrow.names}); use --field")
    for batch in table.iter_batches(columns=[field]):
        yield from (text for text in batch.column(0).to_pylist() if text)


def load_tokenizer(path: Path) -> Tuple[Any, Path, Dict[str, Any]]:
    """(Tokenizer, its tokenizer.json, the directory's tokenizer_config.json or {})."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"error: --tokenizer {path}: no tokenizer.json there (a Hugging Face fast tokenizer)")
    config_file = file.parent / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return Tokenizer.from_file(str(file)), file, config


def train_tokenizer(files: List[Path], field: str, vocab: int, out: Path) -> Path:
    """A byte-level BPE with an ``<|endoftext|>`` token, trained on the inputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(files, field), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def special_id(tok: Any, config: Dict[str, Any], key: str, given: Optional[str], names: Tuple[str, ...]) -> Optional[int]:
    """Id of the ``key`` token (eos/bos): ``given``, else tokenizer_config.json's, else a usual name."""
    text = given or config.get(f"{key}_token")
    if isinstance(text, dict):
        text = text.get("content")
    for name in ([text] if text else list(names)):
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
        if text:
            raise SystemExit(f"error: --{key} {text!r} is not a token of the tokenizer")
    return None


def in_val(index: int, seed: int, fraction: float) -> bool:
    return zlib.crc32(f"{seed}:{index}".encode()) < fraction * 2**32


def batches(docs: Iterator[str]) -> Iterator[List[str]]:
    batch: List[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_all(tok: Any, docs: Iterator[str]) -> Iterator[Tuple[List[str], List[Any]]]:
    """(batch, encodings), the next batch encoding (on every core, in Rust) while the caller
    writes this one."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for batch in batches(docs):
            future = pool.submit(encode, batch)
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (batch, future)
        if pending is not None:
            yield pending[0], pending[1].result()


def write_splits(tok: Any, docs: Iterator[str], out: Path, dtype: np.dtype, eos: int, seed: int, fraction: float,
                 progress: bool) -> Dict[str, Dict[str, int]]:
    """Encode and append every document to train.bin / val.bin; the counts per split.
    The last training document is held back until the end: when no document fell in
    the validation split (few documents), it becomes the split's one document."""
    from tqdm import tqdm

    counts = {"train": {"documents": 0, "tokens": 0}, "val": {"documents": 0, "tokens": 0}}
    held: Optional[np.ndarray] = None
    bar = tqdm(unit="doc", disable=not progress, desc="tokenizing", mininterval=1.0)
    with open(out / (TRAIN_BIN + ".tmp"), "wb") as train, open(out / (VAL_BIN + ".tmp"), "wb") as val:
        files = {"train": train, "val": val}
        for batch, encodings in encode_all(tok, docs):
            parts: Dict[str, List[np.ndarray]] = {"train": [], "val": []}
            for enc in encodings:
                index = counts["train"]["documents"] + counts["val"]["documents"]
                split = "val" if in_val(index, seed, fraction) else "train"
                ids = enc.ids
                ids.append(eos)
                array = np.asarray(ids, dtype=dtype)
                if split == "train":
                    held, array = array, held
                if array is not None:
                    parts[split].append(array)
                counts[split]["documents"] += 1
                counts[split]["tokens"] += len(ids)
            for split, arrays in parts.items():
                if arrays:
                    np.concatenate(arrays).tofile(files[split])
            bar.update(len(batch))
        if held is not None:
            last = "val" if counts["val"]["documents"] == 0 and counts["train"]["documents"] > 1 else "train"
            held.tofile(files[last])
            if last == "val":
                for key, n in (("documents", 1), ("tokens", len(held))):
                    counts["train"][key] -= n
                    counts["val"][key] += n
    bar.close()
    return counts


def prepare(args: argparse.Namespace) -> Dict[str, Any]:
    files = input_files(args.inputs)
    if not files:
        raise SystemExit("error: no input files")
    args.out.mkdir(parents=True, exist_ok=True)
    tok_path = (train_tokenizer(files, args.field, args.train_tokenizer, args.out / "tokenizer_src")
                if args.train_tokenizer else args.tokenizer)
    tok, tok_file, config = load_tokenizer(tok_path)
    sha = hashlib.sha256(tok_file.read_bytes()).hexdigest()
    eos = special_id(tok, config, "eos", args.eos, EOS_NAMES)
    if eos is None:
        raise SystemExit(f"error: --tokenizer {tok_path} has no EOS token I know ({', '.join(EOS_NAMES)}); name "
                         "it with --eos TOKEN")
    bos = special_id(tok, config, "bos", None, ("<|begin_of_text|>", "<s>", "<bos>"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 65536 else np.uint32)
    t0 = time.perf_counter()
    extra = _write(args, files, tok, tok_file, config, dtype, eos)
    seconds = time.perf_counter() - t0
    for name in TOKENIZER_FILES:  # shipped with the data (and with an export of a run trained on it)
        if name == "chat_template.jinja" and args.chat_template is not None:
            continue  # the --chat-template given, written by _write
        src = tok_file if name == "tokenizer.json" else tok_file.parent / name
        if src.is_file() and src.resolve() != (args.out / name).resolve():
            shutil.copy2(src, args.out / name)
    shutil.rmtree(args.out / "tokenizer_src", ignore_errors=True)
    info = {"tokenizer": str(Path(tok_path).resolve()) if not args.train_tokenizer else "trained (--train-tokenizer)",
            "tokenizer_sha256": sha,
            "tokenizer_copy": "tokenizer.json", "vocab_size": vocab, "eos_id": eos, "bos_id": bos,
            "dtype": dtype.name, "inputs": [str(f) for f in files], "field": args.field, "seed": args.seed,
            "val_fraction": args.val_fraction, **extra, "seconds": round(seconds, 3)}
    if args.chat_template is not None:
        info["chat_template"] = str(args.chat_template.resolve())
    (args.out / MANIFEST).write_text(json.dumps(info, indent=1))
    return info


def _write(args: argparse.Namespace, files: List[Path], tok: Any, tok_file: Path, config: Dict[str, Any],
           dtype: np.dtype, eos: int) -> Dict[str, Any]:
    """Write the splits; the manifest's fields about them."""
    if args.chat:
        from train.data.chat import ChatTemplate, special_tokens, template_source
        from train.data.chat_prepare import write_chat

        if args.chat_template is not None:
            if not args.chat_template.is_file():
                raise SystemExit(f"error: --chat-template {args.chat_template} does not exist; give a Jinja file")
            source = args.chat_template.read_text(encoding="utf-8")
            (args.out / "chat_template.jinja").write_text(source, encoding="utf-8")
        else:
            source = template_source(tok_file, config)
        template = ChatTemplate(source, special_tokens(config), args.loss_on)
        pad = special_id(tok, config, "pad", None, ()) if config.get("pad_token") else None
        return {**write_chat(args, tok, template, files, dtype, in_val), "pad_id": eos if pad is None else pad}
    counts = write_splits(tok, documents(files, args.field), args.out, dtype, eos, args.seed, args.val_fraction,
                          progress=not args.no_progress and sys.stderr.isatty())
    for name in (TRAIN_BIN, VAL_BIN):
        os.replace(args.out / (name + ".tmp"), args.out / name)
    return {"splits": counts}


def main(argv: Optional[List[str]] = None) -> int:
    info = prepare(parse(sys.argv[1:] if argv is None else argv))
    train, val = info["splits"]["train"], info["splits"]["val"]
    total = train["tokens"] + val["tokens"]
    if info.get("format") == "chat":
        print(f"{info['conversations']} conversations: {info['truncated']} truncated, {info['dropped']} dropped "
              f"(--max-length {info['max_length'] or 'none'}); loss on {info['loss_on']} ({info['spans']}): "
              f"{train['loss_tokens']:,} of train's {train['tokens']:,} tokens")
    print(f"{train['documents'] + val['documents']} documents, {total:,} tokens "
          f"({total / max(info['seconds'], 1e-9):,.0f} tokens/s): train {train['tokens']:,}, val {val['tokens']:,}; "
          f"vocab {info['vocab_size']}, eos id {info['eos_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
