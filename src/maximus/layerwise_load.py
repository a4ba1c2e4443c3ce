"""Load a QLoRA base one decoder layer at a time, straight into its streamed home.

With ``optimization.offload.params`` a QLoRA model may be larger than the device: Transformers'
`from_pretrained` would quantize every layer onto the device first. `load_layerwise_qlora`
instead builds the model's skeleton without weights, loads the final norm and the head onto the
device and an untied input embedding into host memory (where streaming keeps it,
`maximus.memory.host_embedding`), then for each decoder layer in turn reads its weights from the
safetensors files, quantizes each linear layer to NF4 on the device (bitsandbytes, double
quantization, 64-value blocks: what `from_pretrained` makes, byte for byte), puts the layer's
4-bit storages into the weight store (`maximus.memory.weight_store`) and releases them from the
device before the next layer is read. The device never holds more than one layer's weights
beyond the norm and head (and a tied embedding), and the host never holds the model whole.

A disk store that already holds this model and quantization (`fingerprint`) is used as it is:
no layer is read or quantized again; each 4-bit weight is rebuilt empty (its quantization
state's shapes and fields are in the cache's manifest) and filled by the streamer when used.

Only a local directory of safetensors files whose names match the model's parameters loads this
way (`maximus.model_source.ModelSource.layerwise_directory`); anything else loads whole and
streams from there.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from maximus.model_source import ModelSource, safetensors_weight_map

__all__ = ["layerwise_fingerprint", "load_layerwise_qlora", "random_layerwise_qlora", "weight_store_for_run"]

#: NF4 with double quantization, 64-value blocks, uint8 storage: `maximus.models._quantization_config`.
QUANTIZATION = {"quant_type": "nf4", "double_quant": True, "blocksize": 64, "storage": "uint8"}


def layerwise_fingerprint(directory: Path, dtype: torch.dtype) -> dict[str, Any]:
    """What makes two loads' 4-bit layers the same: the weight files (name, size, modification
    time), the config, the quantization, the compute dtype and bitsandbytes' version."""
    import bitsandbytes

    files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")
    return {"model": str(directory.resolve()), "config": (directory / "config.json").read_text(),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
            "quantization": QUANTIZATION, "dtype": str(dtype), "bitsandbytes": bitsandbytes.__version__}


class _Checkpoint:
    """Tensors by name from a directory of safetensors files, each file opened once."""

    def __init__(self, directory: Path, weight_map: dict[str, str]):
        from safetensors import safe_open

        self.weight_map = weight_map
        self._files = {name: safe_open(str(directory / name), framework="pt") for name in set(weight_map.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self._files[self.weight_map[name]].get_tensor(name)


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _quant_fields(qs) -> dict[str, Any]:
    fields = {"shape": list(qs.shape), "dtype": str(qs.dtype), "blocksize": qs.blocksize, "quant_type": qs.quant_type}
    if qs.state2 is not None:
        fields.update(nested_blocksize=qs.state2.blocksize, nested_dtype=str(qs.state2.dtype))
    return fields


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` whose storage holds nothing yet (the streamer fills it)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _linear4bit(linear: nn.Linear, dtype: torch.dtype):
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit(linear.in_features, linear.out_features, linear.bias is not None, dtype,
                             compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8, device="meta")


def _quantized(new, weight: torch.Tensor, device: torch.device):
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(weight, requires_grad=False, blocksize=QUANTIZATION["blocksize"], compress_statistics=True,
                             quant_type="nf4", quant_storage=torch.uint8, module=new).to(device)


def _rebuilt(new, fields: dict[str, Any], shapes: list[list[int]], device: torch.device):
    """An empty 4-bit weight with the quantization state `fields` describe (from a disk cache)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    data, absmax, code, offset, nested_absmax, nested_code = (
        _empty(shape, dtype, device) for shape, dtype in zip(shapes, (torch.uint8, torch.uint8, torch.float32,
                                                                    torch.float32, torch.float32, torch.float32)))
    nested = QuantState(absmax=nested_absmax, code=nested_code, blocksize=fields["nested_blocksize"],
                        dtype=_dtype(fields["nested_dtype"]))
    state = QuantState(absmax=absmax, shape=torch.Size(fields["shape"]), code=code, blocksize=fields["blocksize"],
                       quant_type=fields["quant_type"], dtype=_dtype(fields["dtype"]), offset=offset, state2=nested)
    weight = bnb.nn.Params4bit(data, requires_grad=False, quant_state=state, blocksize=fields["blocksize"],
                               compress_statistics=True, quant_type=fields["quant_type"], quant_storage=torch.uint8,
                               module=new, bnb_quantized=True)
    new.quant_state = state
    return weight


def load_layerwise_qlora(directory: Path, config, *, device: torch.device, dtype: torch.dtype, attention: str,
                         trust_remote_code: bool, store) -> nn.Module | None:
    """The QLoRA base of `directory` with every decoder layer's 4-bit weights in `store` and
    released from the device (see the module docstring), or None when the checkpoint's names do
    not match the model's (the caller loads it whole)."""
    weight_map = safetensors_weight_map(directory)
    model = _skeleton(config, dtype=dtype, attention=attention, trust_remote_code=trust_remote_code)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()}
    if any(name not in weight_map for name, _ in model.named_parameters() if name not in tied):
        return None
    checkpoint = _Checkpoint(directory, weight_map)
    return _fill(model, device=device, dtype=dtype, store=store, read=checkpoint.get)


def random_layerwise_qlora(config, *, device: torch.device, dtype: torch.dtype, attention: str, store,
                           seed: int = 0) -> nn.Module:
    """A QLoRA model of `config`'s shape with random weights, built like `load_layerwise_qlora`
    builds one from a checkpoint (each layer's 4-bit weights into `store` before the next layer
    exists) but with random NF4 bytes and quantization state instead of quantized weights, so
    that a 70B-shaped model builds in seconds (benchmarks; no checkpoint)."""
    model = _skeleton(config, dtype=dtype, attention=attention, trust_remote_code=False)
    generator = torch.Generator(device=device).manual_seed(seed)
    return _fill(model, device=device, dtype=dtype, store=store, read=None, generator=generator)


def _skeleton(config, *, dtype: torch.dtype, attention: str, trust_remote_code: bool) -> nn.Module:
    """`config`'s model with its parameters on the meta device (buffers are real: RoPE's frequencies)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention,
                                                trust_remote_code=trust_remote_code)


def _random_nf4(new, linear: nn.Linear, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
    """Random NF4 bytes with a valid double-quantized state: weights of about 0.02 in magnitude."""
    from bitsandbytes.functional import create_dynamic_map, get_4bit_type

    n = linear.in_features * linear.out_features
    blocks = -(-n // QUANTIZATION["blocksize"])
    fields = {"shape": [linear.out_features, linear.in_features], "dtype": str(dtype),
              "blocksize": QUANTIZATION["blocksize"], "quant_type": "nf4", "nested_blocksize": 256,
              "nested_dtype": "torch.float32"}
    shapes = [[(n + 1) // 2, 1], [blocks], [16], [], [-(-blocks // 256)], [256]]
    weight = _rebuilt(new, fields, shapes, device)
    qs = weight.quant_state
    values = [torch.randint(0, 256, shapes[0], dtype=torch.uint8, generator=generator, device=device),
              torch.randint(0, 256, shapes[1], dtype=torch.uint8, generator=generator, device=device),
              get_4bit_type("nf4", device=device), torch.tensor(0.02, device=device),
              torch.full(shapes[4], 0.02 / 127, device=device), create_dynamic_map().to(device)]
    for t, v in zip((weight, qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code), values):
        t.untyped_storage().resize_(v.numel() * v.element_size())
        with torch.no_grad():
            t.copy_(v)
    return weight


def _fill(model: nn.Module, *, device: torch.device, dtype: torch.dtype, store, read,
          generator: torch.Generator | None = None) -> nn.Module:
    """Give the skeleton `model` its weights: `read(name)` for each (None: random), every decoder
    layer's linear layers in NF4 parked in `store` and released before the next layer."""
    from maximus.memory.weight_streaming import storage_bytes, streamed_storages
    from maximus.structure import find_decoder_layers

    def value(name: str, like: torch.Tensor, where: torch.device = device) -> torch.Tensor:
        if read is not None:
            return read(name).to(device=where, dtype=dtype)
        if name.endswith("norm.weight"):
            return torch.ones(like.shape, dtype=dtype, device=where)
        return (torch.randn(like.shape, generator=generator, device=device) * 0.02).to(device=where, dtype=dtype)

    _, layers = find_decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is layers) + "."
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()}
    # An untied input embedding goes straight to host memory, where streaming keeps it
    # (`maximus.memory.host_embedding`): a 70B's 2 GiB table never visits the device.
    embedding = model.get_input_embeddings()
    host_table = None if tied else next((n for n, p in model.named_parameters() if p is embedding.weight), None)
    for name, p in list(model.named_parameters()):
        if not name.startswith(prefix):
            _set_parameter(model, name, value(name, p, torch.device("cpu") if name == host_table else device))
    if tied:
        model.tie_weights()
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)
    reuse = getattr(store, "reused", False)
    modules_meta = store.extra.get("modules") if reuse else []
    for i, layer in enumerate(layers):
        local = f"{prefix}{i}."
        linears = [(n, m) for n, m in layer.named_modules() if type(m) is nn.Linear]
        for k, (name, linear) in enumerate(linears):
            new = _linear4bit(linear, dtype)
            if reuse:
                new.weight = _rebuilt(new, modules_meta[i][k]["fields"], modules_meta[i][k]["shapes"], device)
            elif read is None:
                new.weight = _random_nf4(new, linear, device, dtype, generator)
            else:
                new.weight = _quantized(new, read(f"{local}{name}.weight").to(dtype), device)
            if linear.bias is not None:
                new.bias = nn.Parameter(value(f"{local}{name}.bias", linear.bias), requires_grad=False)
            new.requires_grad_(False)
            layer.set_submodule(name, new)
        for name, p in list(layer.named_parameters()):
            if type(p) is nn.Parameter and p.is_meta:  # norms
                _set_parameter(layer, name, value(f"{local}{name}", p))
        if not reuse:
            large, _ = streamed_storages([layer])
            store.put(i, [storage_bytes(t) for t in large[0]])
            modules_meta.append([{"fields": _quant_fields(m.weight.quant_state),
                                  "shapes": [list(t.shape) for t in _pieces(m.weight)]}
                                 for _, m in layer.named_modules() if _is_linear4bit(m)])
            for t in large[0]:
                t.untyped_storage().resize_(0)
    if not reuse:
        store.commit({"modules": modules_meta})
    model.is_loaded_in_4bit = True
    model.config.use_cache = False
    return model


def _is_linear4bit(m: nn.Module) -> bool:
    return type(m).__name__ == "Linear4bit" and getattr(m.weight, "quant_state", None) is not None


def _pieces(weight) -> list[torch.Tensor]:
    qs = weight.quant_state
    return [weight, qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code]


def weight_store_for_run(source: ModelSource, mode: str, *, device: torch.device, dtype: torch.dtype, method: str):
    """The store `optimization.offload.params: on | disk` streams from, checked against this
    machine before anything loads (`maximus.memory.streamed_weights.check_stream_capacity`);
    `source`: the run's resolved model (`maximus.model_source`), its shape read from its config.

    ``disk`` with a local safetensors model: the cache of this model and quantization under
    ``$MAXIMUS_CACHE/streamed-weights/``, reused when complete. Any other model's layers are
    written afresh (a hub id names no fixed files to key a cache by)."""
    import psutil

    from maximus.memory.shape import model_shape
    from maximus.memory.streamed_weights import check_stream_capacity, streamed_layer_bytes
    from maximus.memory.weight_store import DiskWeightStore, HostWeightStore, streamed_cache_dir

    shape = model_shape(source.config)
    b = torch.tensor([], dtype=dtype).element_size()
    needed = shape.num_layers * streamed_layer_bytes(shape, method, b)
    pin = device.type == "cuda"
    if mode == "disk":
        directory = source.layerwise_directory
        reusable = directory is not None and method == "qlora"
        fingerprint = (layerwise_fingerprint(directory, dtype) if reusable
                       else {"model": source.name, "method": method, "dtype": str(dtype)})
        store = DiskWeightStore(streamed_cache_dir(fingerprint), fingerprint, pin=pin)
        cached = reusable and store.open()
        check_stream_capacity("disk", needed, host_available=psutil.virtual_memory().available,
                              cache_dir=store.directory, cached=cached)
        return store
    from maximus.files import cache_root

    check_stream_capacity("on", needed, host_available=psutil.virtual_memory().available, cache_dir=cache_root())
    return HostWeightStore(pin=pin)
