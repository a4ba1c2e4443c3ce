"""A Llama whose MLP is `mlp_expansion` x hidden wide, whatever `intermediate_size` says.

config.json still reads like a Llama's (hidden_size, intermediate_size, ...), so Maximus's
estimator, which models the architecture from those fields, under-predicts every MLP
activation: a model the estimator does not know, by construction. Loaded with
``trust_remote_code`` from the model directory, as a user's custom architecture would be."""
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP


class WideLlamaConfig(LlamaConfig):
    model_type = "wide_llama"

    def __init__(self, mlp_expansion: int = 32, **kwargs):
        self.mlp_expansion = mlp_expansion
        super().__init__(**kwargs)


class WideLlamaForCausalLM(LlamaForCausalLM):
    config_class = WideLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        wide = LlamaConfig(**{**config.to_dict(), "intermediate_size": config.hidden_size * config.mlp_expansion})
        for layer in self.model.layers:
            layer.mlp = LlamaMLP(wide)
        self.post_init()
