"""Streamed 4-bit weights (`optimization.offload.params: on | disk`): a QLoRA base loaded one layer
at a time into host memory or a memory-mapped file, streamed one layer ahead, trains exactly like
the resident model (Transformers' `from_pretrained` NF4 + PEFT as the oracle); at most three layers'
weights are on the device; a run killed with SIGKILL resumes with the disk cache in place; a
machine without the memory or disk is refused before anything loads."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

from maximus import Config, Trainer
from maximus.errors import ConfigError
from maximus.layerwise_load import layerwise_fingerprint, load_layerwise_qlora, weight_store_for_run
from maximus.memory.meter import unique_storage_bytes
from maximus.memory.streamed_weights import check_stream_capacity
from maximus.memory.weight_store import DiskWeightStore, HostWeightStore
from maximus.memory.weight_streaming import FrozenWeightStreamer, storage_bytes, streamed_storages
from maximus.model_source import ModelSource
from maximus.structure import find_decoder_layers

from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion

LAYERS = 4
IDS = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "llama", layers=LAYERS, hidden=128)


def _with_adapter(model):
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.train()
    return model


def _from_pretrained(directory: Path):
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8)
    return AutoModelForCausalLM.from_pretrained(str(directory), quantization_config=nf4, dtype=torch.float32,
                                                device_map={"": "cpu"})


def _layerwise(directory: Path, store):
    model = load_layerwise_qlora(directory, AutoConfig.from_pretrained(str(directory)), device=torch.device("cpu"),
                                 dtype=torch.float32, attention="sdpa", trust_remote_code=False, store=store)
    assert model is not None
    return model


def _step(model, on_layer=None):
    handles = []
    if on_layer is not None:
        for layer in find_decoder_layers(model)[1]:
            handles.append(layer.register_forward_pre_hook(lambda m, a: on_layer()))
            handles.append(layer.register_full_backward_hook(lambda m, gi, go: on_layer()))
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    for h in handles:
        h.remove()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_layer_by_layer_nf4_streams_exactly_with_at_most_three_layers_on_the_device(four_layers, tmp_path):
    reference_model = _from_pretrained(four_layers)
    # The oracle's 4-bit storages, layer by layer: what the layer-by-layer loader must write.
    reference_bytes = [[bytes(storage_bytes(t).numpy()) for t in layer] for layer in streamed_storages(
        find_decoder_layers(reference_model)[1])[0]]
    reference = _step(_with_adapter(reference_model))
    fingerprint = layerwise_fingerprint(four_layers, torch.float32)
    cache = tmp_path / "cache"
    stores = {"on": lambda: HostWeightStore(pin=False),
              "disk": lambda: DiskWeightStore(cache, fingerprint, pin=False),
              "disk, cache reused": lambda: DiskWeightStore(cache, fingerprint, pin=False)}
    for mode, make in stores.items():
        store = make()
        assert store.open() if mode == "disk, cache reused" else True
        model = _with_adapter(_layerwise(four_layers, store))
        streamer = FrozenWeightStreamer(model, store)
        for i, layer in enumerate(reference_bytes):
            held = store.host_tensors(i)
            assert [bytes(h.numpy()) for h in held] == layer, (mode, i)
            store.done(i)
        layers = find_decoder_layers(model)[1]
        quantized = [[t for t in ts] for ts in streamed_storages(layers)[0]]
        one_layer = sum(h.numel() for h in store.host_tensors(0))
        store.done(0)
        on_device = []  # the meter's count of 4-bit bytes on the device, at every layer's forward and backward
        loss, grads = _step(model, lambda: on_device.append(unique_storage_bytes(t for ts in quantized for t in ts)[0]))
        assert loss == reference[0], mode
        for name, grad in reference[1].items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")
        assert streamer.stats["most_resident_layers"] == 3, mode
        assert 2 * one_layer <= max(on_device) <= 3 * one_layer, mode
        streamer.store.close()


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


# The child holds after its first checkpoint (written atomically: the folder appears whole) until
# it is killed, so a parent slowed by the machine's load cannot find it finished.
RUNNER = """
import sys, time
from maximus.train import trainer as t
orig = t.Trainer.__init__
def hold(tr, step):
    time.sleep(0.3)
    while (tr.run_dir / "checkpoints" / "step-000001").exists():
        time.sleep(1)
def slow_init(self, cfg, **kw):
    orig(self, cfg, hooks={"after_backward": hold}, **kw)
t.Trainer.__init__ = slow_init
from maximus.cli import train_main
sys.exit(train_main(sys.argv[1:]))
"""


def test_qlora_streaming_from_disk_resumes_after_sigkill_and_trains_like_resident(four_layers, tmp_path, monkeypatch):
    """A run with the weights resident here; one with `offload.params: disk` in a child process,
    killed with SIGKILL after its first checkpoint, then run again here: it resumes, reuses the
    cache the killed run wrote, and ends with the resident run's losses and adapter (fp32, to 1e-6).
    (`on` is exact at the step above, with the same streamer.)"""
    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path / "cache"))
    data = write_prompt_completion(tmp_path / "data.jsonl")

    def cfg(mode: str) -> dict:
        return tiny_config(four_layers, data, tmp_path / mode, method="qlora",
                           optimization={"offload": {"params": mode}, "gradient_checkpointing": "off"},
                           training={"save_every": 1, "max_steps": 3}, eval={"enabled": False})

    path = tmp_path / "disk.yaml"
    path.write_text(yaml.safe_dump(cfg("disk")))
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    Trainer(Config.from_dict(cfg("off"))).train()  # meanwhile: the oracle
    t0 = time.time()
    while not (tmp_path / "disk" / "checkpoints" / "step-000001").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 240
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    manifests = list((tmp_path / "cache" / "streamed-weights").glob("*/manifest.json"))
    assert len(manifests) == 1
    written = manifests[0].parent.joinpath("layers.bin").stat().st_mtime_ns
    resumed = Trainer(Config.from_dict(cfg("disk")))
    resumed.train()
    assert resumed.weight_store.reused and resumed.streamer.stats["most_resident_layers"] == 3
    assert manifests[0].parent.joinpath("layers.bin").stat().st_mtime_ns == written
    reference = _losses(tmp_path / "off")
    assert len(reference) == 3
    assert _losses(tmp_path / "disk") == pytest.approx(reference, abs=1e-6)
    ours = load_file(str(tmp_path / "disk" / "adapter" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "off" / "adapter" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=1e-6, msg=k)


def test_too_little_host_memory_or_disk_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_stream_capacity("on", 40 * 2**30, host_available=12 * 2**30, cache_dir=tmp_path)
    assert re.fullmatch(
        r"optimization\.offload\.params: on needs 40\.0 GiB of host memory for the streamed layers; this machine "
        r"has 12\.0 GiB available \(hint: use offload\.params: disk \([0-9.]+ GiB free under "
        + re.escape(str(tmp_path)) + r"\) or a machine with more memory\)", err.value.one_line())
    check_stream_capacity("on", 40 * 2**30, host_available=41 * 2**30, cache_dir=tmp_path)
    check_stream_capacity("disk", 2**70, host_available=0, cache_dir=tmp_path, cached=True)  # nothing to write


def test_a_model_larger_than_the_disk_is_refused_before_loading(tmp_path, monkeypatch):
    """The check reads the config only: a Llama whose 4-bit layers would fill exabytes."""
    import shutil

    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path / "cache"))
    giant = LlamaConfig(hidden_size=65536, intermediate_size=262144, num_hidden_layers=1_000_000,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=1000)
    source = ModelSource(name=str(tmp_path / "absent"), kind="directory", config=giant, vision=False, family="Llama")
    with pytest.raises(ConfigError) as err:
        weight_store_for_run(source, "disk", device=torch.device("cpu"), dtype=torch.bfloat16, method="qlora")
    line = err.value.one_line()
    free = shutil.disk_usage(tmp_path).free / 2**30
    needed = re.search(r"needs ([0-9.]+) GiB", line).group(1)
    assert line == (f"optimization.offload.params: disk needs {needed} GiB of free disk under "
                    f"{tmp_path / 'cache' / 'streamed-weights'}/{Path(re.search(r'under (.*?) for', line).group(1)).name}"
                    f" for the streamed layers; it has {free:.1f} GiB free (hint: free space there, or point "
                    f"MAXIMUS_CACHE at a larger disk)")
    with pytest.raises(ConfigError, match=r"^optimization\.offload\.params: on needs [0-9.]+ GiB of host memory"):
        weight_store_for_run(source, "on", device=torch.device("cpu"), dtype=torch.bfloat16, method="qlora")


def test_disk_mode_peak_rss_grows_less_than_the_4bit_layers():
    """`benchmarks/streamed_rss.py` in small: one child process builds 24 random NF4 layers into the
    disk store and trains a step; its resident memory grows by less than the layers take (the
    embedding and head of a 1,024-row vocabulary, three layers in flight, rank-1 adapters with their
    AdamW state, the step's temporaries)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from streamed_rss import measure

    (row,) = measure(layers=24, hidden=1024, intermediate=2752, seq=8, modes=("disk",), vocab=1024, rank=1)
    assert row["most_resident_layers"] == 3
    assert row["layer_bytes"] > 120 * 2**20
    assert row["peak_rss_bytes"] - row["baseline_rss_bytes"] < row["layer_bytes"]


def test_qlora_streaming_evaluates_and_generates_like_the_resident_run(four_layers, tmp_path, monkeypatch):
    """`offload.params: on` with the evaluation on (held-out loss, exact match over greedy
    completions and the prompts' generations, before and after training): run.json's eval and the
    losses equal the resident run's (fp32). Generation goes through Transformers' `generate`, which
    moves its inputs to ``model.device`` before every forward (the layers', not the host table's).
    On a CPU with AVX512-BF16 the resident run also checks `maximus.compat.keep_4bit_training_layout`:
    without it the eval before training repacks its 4-bit weights for a kernel without backward."""
    monkeypatch.setenv("MAXIMUS_CACHE", str(tmp_path / "cache"))
    data = write_prompt_completion(tmp_path / "data.jsonl")
    runs = {}
    for mode in ("off", "on"):
        cfg = tiny_config(four_layers, data, tmp_path / mode, method="qlora",
                          optimization={"offload": {"params": mode}, "gradient_checkpointing": "off"},
                          training={"max_steps": 2},
                          eval={"split": 0.1, "before": True, "exact_match": 3, "max_new_tokens": 6,
                                "prompts": ["Reverse: red green blue\nAnswer:"]})
        trainer = Trainer(Config.from_dict(cfg))
        trainer.train()
        runs[mode] = json.loads((tmp_path / mode / "run.json").read_text())["eval"]
        if mode == "on":
            assert trainer.streamer.host_embedding is not None and trainer.streamer.stats["fetches"] > 0
    for when in ("before", "after"):
        resident, streamed = runs["off"][when], runs["on"][when]
        assert streamed["generations"] == resident["generations"] and len(resident["generations"]) == 1, when
        assert streamed["exact_match"] == resident["exact_match"] is not None, when
        assert streamed["loss"] == pytest.approx(resident["loss"], abs=1e-6), when
    assert _losses(tmp_path / "on") == pytest.approx(_losses(tmp_path / "off"), abs=1e-6)
