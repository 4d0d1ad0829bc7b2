"""Which role each parameter plays (DESIGN §3): module types first, then family knowledge.

Rules, in order (first match wins):
  1. the user's ``role_overrides`` regexes;
  2. the input embedding matrix -> token_embedding; an untied output embedding -> lm_head;
  3. parameters of normalisation modules -> norm;
  4. anything inside an attention module (Q/K/V/O, fused QKV, LoRA adapters on them) -> attention;
  5. other embedding tables (positions, token types) -> position_embedding;
  6. remaining biases -> bias;
  7. classification / pooling heads -> head;
  8. MLP expansion and contraction matrices (incl. LoRA adapters on them) -> mlp;
  9. anything else -> other (flooded, with a warning; an error with ``strict=True``).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from torch import nn

from .config import AegisConfig, Treatment

# Family knowledge: class-name and parameter-path patterns of the transformers families we cover
# (GPT-2/J/NeoX, OPT, LLaMA/Mistral/Qwen, Gemma, Phi, BERT/RoBERTa/DeBERTa, T5-style blocks).
_ATTENTION_CLASS = re.compile(r"Attention|SelfOutput$|Attn")
_ATTENTION_PATH = re.compile(r"(^|\.)(attn|attention|self_attn|self_attention|cross_attn|encoder_attn)(\.|$)")
_NORM_CLASS = re.compile(r"Norm")
_MLP_CLASS = re.compile(r"MLP|Intermediate|FeedForward|FFN|Mlp|(?<!Self)Output$|Expert")
_MLP_PATH = re.compile(
    r"(^|\.)(mlp|ffn|feed_forward|intermediate|experts|fc1|fc2|fc_in|fc_out|c_fc|w1|w2|w3|"
    r"up_proj|gate_proj|down_proj|gate_up_proj|dense_h_to_4h|dense_4h_to_h|wi|wo)(\.|$)"
)
_HEAD_PATH = re.compile(r"(^|\.)(score|classifier|pooler|qa_outputs|cls|heads?|out_head)(\.|$)")


@dataclass(frozen=True)
class ParamPlan:
    """One parameter's role and what AEGIS does to its gradient."""

    name: str
    param: nn.Parameter
    role: str
    treatment: Treatment
    trainable: bool
    clean: bool  # allow-listed by the user: exported without flood

    @property
    def flooded(self) -> bool:
        return self.trainable and not self.clean and self.treatment.kind != "frozen"

    @property
    def action(self) -> str:
        if self.treatment.kind == "frozen":
            return "frozen"
        if not self.trainable:
            return "not trainable"
        if self.clean:
            return "CLEAN (allow-listed)"
        return self.treatment.describe()


def _module_path(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules from the root down to the one owning parameter ``name``."""
    chain, module = [model], model
    for part in name.split(".")[:-1]:
        module = getattr(module, part)
        chain.append(module)
    return chain


def detect_role(model: nn.Module, name: str, param: nn.Parameter, overrides: list[tuple[re.Pattern, str]]) -> str:
    for pattern, role in overrides:
        if pattern.search(name):
            return role
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is not None and param is getattr(embeddings, "weight", None):
        return "token_embedding"
    if head is not None and param is getattr(head, "weight", None):
        return "lm_head"
    chain = _module_path(model, name)
    owner, leaf = chain[-1], name.rsplit(".", 1)[-1]
    classes = [type(m).__name__ for m in chain[1:]]
    path = name.rsplit(".", 1)[0] if "." in name else ""
    if _NORM_CLASS.search(type(owner).__name__):
        return "norm"
    if any(_ATTENTION_CLASS.search(c) for c in classes) or _ATTENTION_PATH.search(path):
        return "attention"
    if isinstance(owner, nn.Embedding):
        return "position_embedding"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "bias"
    if _HEAD_PATH.search(path) or owner is head:
        return "head"
    if param.dim() >= 2 and (any(_MLP_CLASS.search(c) for c in classes) or _MLP_PATH.search(path)):
        return "mlp"
    return "other"


def plan(model: nn.Module, config: AegisConfig) -> list[ParamPlan]:
    """Classify every parameter of ``model``; warn (or raise if strict) on unknown trainable ones."""
    params = list(model.named_parameters())
    if not params:
        raise ValueError("the model has no parameters: pass the model you train (e.g. a transformers PreTrainedModel)")
    overrides = [(re.compile(p), r) for p, r in config.role_overrides.items()]
    clean = [re.compile(p) for p in config.allow_clean]
    treatments = config.treatments
    plans = []
    for name, param in params:
        role = detect_role(model, name, param, overrides)
        plans.append(
            ParamPlan(
                name=name,
                param=param,
                role=role,
                treatment=treatments[role],
                trainable=param.requires_grad,
                clean=any(p.search(name) for p in clean),
            )
        )
    unknown = [p.name for p in plans if p.role == "other" and p.trainable]
    if unknown:
        message = (
            f"AEGIS does not know the role of {len(unknown)} trainable parameter(s) {unknown[:5]}; "
            "they get the 'other' flood. Name their role with AegisConfig(role_overrides={regex: role})."
        )
        if config.strict:
            raise ValueError(message + " (strict=True)")
        warnings.warn(message, stacklevel=3)
    return plans
