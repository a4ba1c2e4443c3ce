"""The batched, KV-cached sampler of GRPO (`maximus.train.sampling`) against Transformers'
`generate` and full-logits recomputation, and the one per-token log-prob function
(`maximus.losses.token_outputs.label_log_probs`) against the full logits."""

import pytest
import torch

from maximus.losses.token_outputs import label_log_probs
from maximus.train.sampling import Draw, next_tokens, sample_groups
from tiny import build_tiny_model_dir, one_thread  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["Reverse: red green blue\nAnswer:", "hi", "a b c d e f g h", "gold stone"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model_dir(tmp_path_factory.mktemp("sampling") / "model")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= 25.0  # EOS now and then
    return model, tok, [tok(t)["input_ids"] for t in TEXTS]


def _cut(ids, eos):
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def test_batched_greedy_equals_generate_prompt_by_prompt(lm):
    """Left-padded prompts of four lengths, one prefill each, the cache expanded to a group of 3,
    finished rows dropped: the same tokens as `generate` on each prompt alone; and the same
    whether the prompts share one decode loop or go one at a time (`prompts_at_once`)."""
    model, tok, prompts = lm
    eos, pad = tok.eos_token_id, tok.pad_token_id
    greedy = Draw(max_new_tokens=10, eos_token_id=eos, pad_token_id=pad, greedy=True)
    out = sample_groups(model, prompts, greedy, group_size=3)
    one = sample_groups(model, prompts, greedy, group_size=3, prompts_at_once=1)
    assert out.completions == one.completions and one.forwards > out.forwards
    lengths = set()
    for p, group in zip(prompts, out.completions):
        ids = torch.tensor([p])
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)[0, len(p):].tolist()
        assert group == [_cut(ref, eos)] * 3
        lengths.add(len(group[0]))
    assert len(lengths) > 1 and out.forwards <= 10  # one prefill, then one forward per token


def test_sampled_tokens_carry_the_log_probs_of_the_distribution_they_were_drawn_from(lm):
    model, tok, prompts = lm
    eos, pad, T = tok.eos_token_id, tok.pad_token_id, 0.7

    def draw(seed):
        draw = Draw(max_new_tokens=8, eos_token_id=eos, pad_token_id=pad, temperature=T, record_logps=True)
        return sample_groups(model, prompts, draw, group_size=4, generator=torch.Generator().manual_seed(seed))

    out = draw(3)
    assert out.completions == draw(3).completions != draw(4).completions  # seeded
    for p, group, logps in zip(prompts, out.completions, out.logps):
        for c, lp in zip(group, logps):
            assert len(c) <= 8 and (eos not in c or c.index(eos) == len(c) - 1)
            with torch.no_grad():
                z = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float() / T
            ref = torch.log_softmax(z, dim=-1).gather(1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)


def test_the_inverse_cdf_draw_picks_each_token_with_its_probability_and_top_p_keeps_transformers_set():
    from transformers.generation.logits_process import TopPLogitsWarper

    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log().repeat(40_000, 1)
    tokens, _ = next_tokens(logits.clone(), generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.01)
    # Tempered: p^(1/T) renormalised.
    tokens, logps = next_tokens(logits.clone(), temperature=2.0, generator=torch.Generator().manual_seed(1),
                                want_logps=True)
    tempered = torch.softmax(probs.log() / 2.0, dim=0)
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    torch.testing.assert_close(freq, tempered, rtol=0, atol=0.01)
    torch.testing.assert_close(logps, tempered.log()[tokens], rtol=0, atol=1e-6)
    for top_p in (0.6, 0.8, 0.95):
        kept = torch.isfinite(TopPLogitsWarper(top_p)(None, probs.log()[None].clone()))[0]
        tokens, _ = next_tokens(logits[:5000].clone(), top_p=top_p, generator=torch.Generator().manual_seed(2))
        assert set(tokens.tolist()) == set(kept.nonzero()[:, 0].tolist())


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("mode", ["exact", "naive"])
def test_label_log_probs_equal_the_full_logits(softcap, temperature, mode):
    """The one per-token log-prob of DPO and GRPO: softcap(y) / temperature, labelled rows only,
    with gradients; a soft-capped head at a temperature included."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight, bias = torch.randn(50, 16) * 0.5, torch.randn(50) * 0.1
    labels = torch.randint(0, 50, (2, 7))
    labels[0, :3] = -100
    ours = label_log_probs(hidden, weight, labels, bias=bias, softcap=softcap, temperature=temperature,
                           chunk_size=4, mode=mode)
    y = hidden @ weight.T + bias
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    ref = torch.log_softmax(y / temperature, dim=-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ref = torch.where(labels == -100, torch.zeros_like(ref), ref)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    grad, = torch.autograd.grad(ours.sum(), hidden)
    ref_grad, = torch.autograd.grad(ref.sum(), hidden)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_the_objectives_share_one_per_token_log_prob():
    """DPO's and GRPO's per-token log-probs are one function, not a dispatch written twice."""
    import inspect

    from maximus.train.objectives import grpo, preference

    for module in (grpo, preference):
        source = inspect.getsource(module)
        assert "label_log_probs(" in source
        assert "token_log_probs(" not in source and "naive_cross_entropy(" not in source


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_untracked_decode_loop_reports_the_peak_the_tracker_sees(lm, top_p):
    """Under a step's CPU meter the decode loop runs paused and reports what it holds
    (`decode_bytes`): the same completions, and the step peak the fully tracked loop measures."""
    from maximus.memory.meter import MemoryMeter

    model, tok, prompts = lm
    runs = []
    for paused in (False, True):
        meter = MemoryMeter("cpu")
        with meter.track(model):
            before = meter.current_bytes()
            meter.reset_peak()
            draw = Draw(max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        temperature=0.7, top_p=top_p)
            out = sample_groups(model, prompts, draw, group_size=4, generator=torch.Generator().manual_seed(5),
                                meter=meter if paused else None)
        runs.append((out.completions, meter.peak_bytes() - before))
    (tracked, tracked_peak), (untracked, untracked_peak) = runs
    assert untracked == tracked
    assert abs(untracked_peak / tracked_peak - 1) < 0.1, (untracked_peak, tracked_peak)


@pytest.mark.parametrize("top_p, record_logps", [(1.0, False), (0.9, False), (1.0, True)])
def test_the_sampler_holds_the_logit_copies_the_planner_charges(top_p, record_logps):
    """Fully tracked, the sampler's peak beyond its KV cache is SAMPLER_LOGIT_COPIES [rows, V]
    float32 tensors (+ TOP_P_LOGIT_COPIES with top-p, + LOGPS_LOGIT_COPIES recording the
    log-probs): a vocabulary large enough that they dominate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.memory.generation import (LOGPS_LOGIT_COPIES, SAMPLER_LOGIT_COPIES, TOP_P_LOGIT_COPIES,
                                           kv_cache_bytes)
    from maximus.memory.meter import MemoryMeter

    vocab, group, new = 32000, 8, 8
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompts = [list(range(5, 5 + n)) for n in (6, 9, 12, 7)]
    meter = MemoryMeter("cpu")
    with meter.track(model):
        before = meter.current_bytes()
        meter.reset_peak()
        draw = Draw(max_new_tokens=new, eos_token_id=vocab + 1, pad_token_id=0, top_p=top_p, record_logps=record_logps)
        sample_groups(model, prompts, draw, group_size=group, generator=torch.Generator().manual_seed(0))
        peak = meter.peak_bytes() - before
    rows = len(prompts) * group
    copies = (peak - kv_cache_bytes(config, sequences=rows, tokens=12 + new, dtype_bytes=4)) / (rows * vocab * 4)
    expected = SAMPLER_LOGIT_COPIES + (TOP_P_LOGIT_COPIES if top_p < 1 else 0) + (LOGPS_LOGIT_COPIES if record_logps else 0)
    assert abs(copies - expected) < 0.1, copies
