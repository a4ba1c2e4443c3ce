"""The input embedding's table in host memory (`maximus.memory.host_embedding`): only a batch's
unique rows move to the device, the model's logits, loss and gradients are exactly the resident
model's (tiny Llama, fp32), a trained or tied table stays on the device, and the estimator's
weights term drops by exactly the table's bytes."""
from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.memory.estimate import estimate_peak
from maximus.memory.host_embedding import install_host_embedding
from maximus.memory.shape import model_shape
from maximus.memory.streamed_weights import STREAMED_IN_FLIGHT, streamed_layer_bytes
from maximus.structure import HOST_KEPT, compute_device

CPU = torch.device("cpu")


def _tiny(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).float()


def test_host_embedding_gives_the_resident_models_logits_loss_and_gradients_moving_only_unique_rows():
    resident = _tiny()
    hosted = copy.deepcopy(resident)
    for model in (resident, hosted):
        model.get_input_embeddings().weight.requires_grad_(False)  # frozen, as under an adapter
    ids = torch.tensor([[5, 7, 5, 9, 7, 7, 11, 5], [9, 9, 2, 5, 2, 11, 13, 7]])
    unique = ids.unique().numel()  # 7 distinct ids among 16 positions
    host = install_host_embedding(hosted, CPU)
    assert host is not None
    expected = resident(input_ids=ids, labels=ids)
    got = hosted(input_ids=ids, labels=ids)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.loss, expected.loss)
    expected.loss.backward()
    got.loss.backward()
    hosted_parameters = dict(hosted.named_parameters())  # the table is registered last: another order
    for name, p in resident.named_parameters():
        if p.requires_grad:
            assert torch.equal(hosted_parameters[name].grad, p.grad), name
    assert host.last_rows_shape == (unique, 64)
    assert host.stats == {"batches": 1, "rows_moved": unique, "bytes_moved": unique * 64 * 4}
    host.remove()
    assert torch.equal(hosted(input_ids=ids).logits, expected.logits)  # hooks gone, same model


def _layers_on_meta(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The split of a streamed CUDA run, on a machine without CUDA: the table on the CPU, the
    decoder layers, the norm and the head on another device (`meta`)."""
    model.requires_grad_(False)
    for module in (model.model.layers, model.model.norm, model.lm_head):
        module.to("meta")
    return model


def test_compute_device_is_the_layers_while_the_first_parameter_is_the_host_tables():
    model = _layers_on_meta(_tiny())
    setattr(model.get_input_embeddings(), HOST_KEPT, True)
    assert model.device == CPU  # Transformers reads the first parameter: the table's
    assert compute_device(model) == torch.device("meta")
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    assert compute_device(adapted) == torch.device("meta")
    assert compute_device(torch.nn.Module()) == CPU


def test_host_embedding_registers_the_table_last_so_model_device_is_the_layers():
    """`generate` moves its inputs to ``model.device`` before every forward: with the table first
    it would say ``cpu`` while the layers run elsewhere. remove() restores the order."""
    model = _layers_on_meta(_tiny())
    order = [name for name, _ in model.named_parameters()]
    assert model.device == CPU
    host = install_host_embedding(model, torch.device("meta"))
    assert host is not None and model.get_input_embeddings().weight.device == CPU
    assert model.device == torch.device("meta")
    assert compute_device(model) == torch.device("meta")
    assert [name for name, _ in model.named_parameters()] == order[1:-1] + order[:1] + order[-1:]  # last in model.model
    host.remove()
    assert [name for name, _ in model.named_parameters()] == order
    assert not hasattr(model.get_input_embeddings(), HOST_KEPT)


def test_a_trained_or_tied_embedding_stays_on_the_device():
    trained = get_peft_model(_tiny(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]))
    assert install_host_embedding(trained, CPU) is None
    assert trained.get_input_embeddings().weight.requires_grad
    tied = _tiny(tie=True)
    tied.requires_grad_(False)
    assert install_host_embedding(tied, CPU) is None


SEVENTY_B = "meta-llama/Llama-3.1-70B"
PLAN = dict(method="qlora", seq_len=2048, micro_batch=1, checkpointing="full", offload_optimizer=True,
            device="cuda", dtype="bf16")


def test_streaming_takes_the_layers_and_exactly_the_embedding_table_off_the_device():
    shape = model_shape(SEVENTY_B)
    layers = (shape.num_layers - STREAMED_IN_FLIGHT) * streamed_layer_bytes(shape, "qlora", 2)
    table = shape.vocab_size * shape.hidden_size * 2  # 128,256 x 8,192 in bf16: 1.96 GiB
    resident = estimate_peak(SEVENTY_B, **PLAN)
    streamed = estimate_peak(SEVENTY_B, offload_params="on", **PLAN)
    assert resident.breakdown["weights"] - streamed.breakdown["weights"] == layers + table
    assert resident.peak_bytes - streamed.peak_bytes == layers + table
    assert streamed.host_bytes - resident.host_bytes == shape.num_layers * streamed_layer_bytes(shape, "qlora", 2) + table
    # A trained table (lora.modules_to_save) stays on the device: only the layers leave it.
    kept = dict(PLAN, modules_to_save=["embed_tokens"])
    assert (estimate_peak(SEVENTY_B, **kept).breakdown["weights"]
            - estimate_peak(SEVENTY_B, offload_params="on", **kept).breakdown["weights"]) == layers
