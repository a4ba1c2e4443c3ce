"""What context parallelism cannot split is refused in one line naming the key and value, with a
hint, before the weights load (the model's config) or before training (the world): attention the
split would change (a sliding window shorter than the rows, soft-capped scores, attention sinks,
attention dropout, image tokens), and GRPO where only its training pass can be split."""
import pytest
from transformers import Gemma2Config, GptOssConfig, LlamaConfig, LlavaConfig, MistralConfig

from maximus import Config
from maximus.errors import ConfigError, ModelError
from maximus.train.context_parallel import check_model_config
from maximus.train.objectives.grpo import check_world

SPLIT = "training.context_parallel 2 cannot"


@pytest.mark.parametrize("config, message", [
    (MistralConfig(sliding_window=16, max_position_embeddings=512),
     f"{SPLIT} split mistral's sliding-window attention (sliding_window 16 tokens, rows of up to 96): the split "
     "attends to the whole causal row (hint: set training.seq_len to at most 16 or training.context_parallel: 1)"),
    (Gemma2Config(), f"{SPLIT} split gemma2's soft-capped attention scores (attn_logit_softcapping 50.0) "
                     "(hint: set training.context_parallel: 1)"),
    (GptOssConfig(), f"{SPLIT} split gpt_oss's attention sinks (one extra logit per head) "
                     "(hint: set training.context_parallel: 1)"),
    (LlamaConfig(attention_dropout=0.1), f"{SPLIT} apply attention dropout (attention_dropout 0.1) to a split row "
                                         "(hint: set attention_dropout: 0.0 in the model's config.json, or "
                                         "training.context_parallel: 1)"),
    (LlavaConfig(), f"{SPLIT} split the rows of a vision-language model (llava): its image features join the rows "
                    "inside the model (hint: set training.context_parallel: 1)"),
], ids=["sliding-window", "soft-cap", "sinks", "dropout", "vision"])
def test_attention_the_split_would_change_is_refused(config, message):
    with pytest.raises(ModelError) as err:
        check_model_config(config, 2, 96)
    assert str(err.value) == message


def test_a_window_the_rows_never_reach_is_no_obstacle():
    check_model_config(MistralConfig(sliding_window=4096), 2, 96)
    check_model_config(LlamaConfig(), 2, 96)


@pytest.mark.parametrize("world, degree, strategy, message", [
    (4, 2, "ddp", "objective grpo under torchrun splits rows only: training.context_parallel (2) must equal the "
                  "number of processes (4) (hint: set training.context_parallel: 4, or run maximus-train without torchrun)"),
    (2, 1, "ddp", "objective grpo under torchrun splits rows only: training.context_parallel (1) must equal the "
                  "number of processes (2) (hint: set training.context_parallel: 2, or run maximus-train without torchrun)"),
    (2, 2, "fsdp", "objective grpo under training.context_parallel 2 runs under DDP, not FSDP2: every rank samples "
                   "whole completions outside the training step (hint: set training.distributed: ddp)"),
])
def test_grpo_refuses_a_world_it_cannot_split(world, degree, strategy, message):
    with pytest.raises(ConfigError) as err:
        check_world(world, degree, strategy)
    assert str(err.value) == message


def test_grpo_refuses_asynchronous_generation_under_the_split():
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": "m", "dataset": "d.jsonl", "objective": "grpo",
                          "grpo": {"async_generation": True}, "training": {"context_parallel": 2}})
    assert str(err.value) == ("config: training.context_parallel 2 cannot run grpo.async_generation: the ranks exchange "
                              "the sampled completions, which a second thread cannot do beside the training step's "
                              "exchanges (hint: set grpo.async_generation: false or training.context_parallel: 1)")
