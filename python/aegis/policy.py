"""Which role each parameter plays (DESIGN §3): module types first, then family knowledge.

Rules, in order (first match wins):
  1. the user's ``role_overrides`` regexes;
  2. the input embedding matrix -> token_embedding; an untied output embedding -> lm_head; a vocabulary
     vector -> lm_head: the output embedding's bias (BERT ``cls.predictions.bias``, RoBERTa
     ``lm_head.bias`` …) or any other 1-D parameter of ``vocab_size`` entries outside the blocks (a
     logits bias). Its gradient, sum_t (softmax_t - onehot(y_t)), is the bag of next tokens, so it gets
     a rows flood along the vocabulary (one row per token id, ``ParamPlan.rows_axis`` 0), never the bias
     role's matrix flood;
  3. peft LoRA factors of an ``nn.Embedding`` or of the output embedding, and peft trainable-token rows
     -> ``LORA_EMBEDDING_ROLE`` (``ParamPlan.rows_axis`` says which axis the token ids index);
  4. parameters of normalisation modules -> norm;
  5. peft LoRA factors (``lora_A`` / ``lora_B``) of an attention projection -> attention_lora, of an MLP
     matrix -> mlp_lora: their own roles, so that a preset can train MLP adapters and, only as an explicit
     opt-in, attention adapters, while the base attention stays frozen (a mapping without these roles gives
     them the treatment of the module they adapt, ``config.LORA_ROLE_PARENT``). A (r x d_in) has the row
     space of the layer's inputs, as a full weight's gradient: DAGER reads it when the batch has fewer
     tokens than r (benchmarks/frontier_delta.py measures ranks 8 / 64 / 256);
  5b. anything else inside an attention module (Q/K/V/O, fused QKV) -> attention;
  6. peft DoRA magnitude vectors (a per-feature gain, the gradient structure of a norm weight) -> norm;
  7. other embedding tables (positions, token types) -> position_embedding: a rows flood along their ids
     at the token embedding's strength;
  8. remaining biases -> bias;
  9. dense matrices applied to every token outside the blocks -> mlp: embedding projections (ALBERT
     ``embedding_hidden_mapping_in``, ELECTRA ``embeddings_project``, OPT ``project_in/out``) and the
     per-token transforms of MLM / replaced-token heads (BERT ``cls.predictions.transform.dense``, ALBERT
     ``predictions.dense``, ELECTRA ``generator_predictions.dense`` / ``discriminator_predictions.dense``,
     RoBERTa ``lm_head.dense``, DistilBERT ``vocab_transform``). Their gradient is a sum over the tokens
     of outer products, the span structure of an MLP gradient, so they get the MLP flood, not the head's;
  10. in classification / pooling heads: the output layer's weight, whose rows are indexed by label
      (``out_features == num_labels``, or far fewer outputs than inputs: QA start/end, multiple choice)
      -> head, a rows flood along the labels like the vocabulary rows of an LM head, because its rows
      carry ``(p - y) h^T`` (the label channel); the hidden transforms of heads (BERT pooler,
      DistilBERT ``pre_classifier``, RoBERTa ``classifier.dense``) -> mlp (outer products of hidden
      states, the MLP's span structure);
  11. MLP expansion and contraction matrices (incl. LoRA adapters on them) -> mlp;
  12. anything else -> other: with ``strict=True`` an error naming the parameters and the fix, else the
      weak 'other' flood with a warning.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from torch import Tensor, nn

from .config import ROLES, AegisConfig, Treatment

# The role of peft LoRA factors on a vocabulary-indexed matrix (at the embedding's strength).
# ``ParamPlan.rows_axis`` says which axis the token ids index.
LORA_EMBEDDING_ROLE = "token_embedding_lora"

# Family knowledge: class-name and parameter-path patterns of the transformers families we cover
# (GPT-2/J/NeoX, OPT, LLaMA/Mistral/Qwen, Gemma, Phi, BERT/RoBERTa/DeBERTa, ALBERT, ELECTRA, DistilBERT,
# T5-style blocks).
_ATTENTION_CLASS = re.compile(r"Attention|SelfOutput$|Attn")
_ATTENTION_PATH = re.compile(r"(^|\.)(attn|attention|self_attn|self_attention|cross_attn|encoder_attn)(\.|$)")
_NORM_CLASS = re.compile(r"Norm")
_MLP_CLASS = re.compile(
    r"MLP|Intermediate|FeedForward|FFN|Mlp|(?<!Self)Output$|Expert|LayerFF$|DenseActDense$|DenseGatedActDense$"
)
_MLP_PATH = re.compile(
    r"(^|\.)(mlp|ffn|ffn_output|feed_forward|intermediate|experts|fc1|fc2|fc_in|fc_out|c_fc|w1|w2|w3|"
    r"up_proj|gate_proj|down_proj|gate_up_proj|dense_h_to_4h|dense_4h_to_h|wi|wi_0|wi_1|wo|DenseReluDense)(\.|$)"
)
# Dense matrices applied to every token outside the blocks (rule 9): MLP span structure.
_TOKEN_DENSE_PATH = re.compile(
    r"(^|\.)(embedding_hidden_mapping_in|embeddings_project|project_in|project_out|vocab_transform|"
    r"predictions\.transform\.dense|predictions\.dense|generator_predictions\.dense|"
    r"discriminator_predictions\.dense|lm_head\.dense)(\.|$)"
)
_HEAD_PATH = re.compile(
    r"(^|\.)(score|classifier|pre_classifier|pooler|qa_outputs|cls|heads?|out_head|dense_prediction)(\.|$)"
)
# peft LoRA: factors of an nn.Embedding live in ParameterDicts, those of a Linear in ModuleDicts of Linears.
_LORA_EMBEDDING_PARTS = ("lora_embedding_A", "lora_embedding_B")
_LORA_LINEAR_PARTS = ("lora_A", "lora_B")
_TRAINABLE_TOKENS = "trainable_tokens_delta"  # peft trainable_token_indices: (k x d), row i for token idx[i]
_DORA_MAGNITUDE = "lora_magnitude_vector"
_ID_INDEXED_ROLES = ("token_embedding", "position_embedding", "lm_head", "head")  # row v: token / label v
# A block's parameters: a vocabulary-sized vector in here is a hidden size, not a logits bias.
_BLOCK_PATH = re.compile(r"(^|\.)(h|layers?|blocks?|block)\.\d+\.")
_CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList, nn.Sequential)


def rows_axis_of(name: str, param: nn.Parameter, role: str) -> int | None:
    """The axis of ``param`` whose slices are indexed by token (position, vocabulary) or label ids, else None.

    0 for embedding tables, the output embedding (V x d: row v belongs to id v), a vocabulary vector
    (lm_head role, V: entry v is id v's row of width 1, see ``rows_view``) and a classifier's output
    layer (C x d: row c is label c's). For peft LoRA on an
    embedding (``LORA_EMBEDDING_ROLE``; ``detect_role`` checked the layout against the base layer):
      * ``lora_embedding_A`` is (r x V) and looked up by column (``F.embedding(x, A.T)``): its gradient is
        non-zero exactly in the columns of the input tokens -> 1;
      * ``lora_embedding_B`` is (d x r), a dense factor: no axis is token-indexed -> None (matrix flood at
        the embedding's strength, see the comment in ``_lora_vocab_factor``);
      * LoRA on the output embedding: ``lora_B`` is (V x r), row v feeds logit v -> 0; ``lora_A`` (r x d)
        is dense -> None;
      * peft ``trainable_token_indices``: ``trainable_tokens_delta`` is (k x d), row i is token idx[i]'s
        (its gradient is non-zero iff that token occurs) -> 0.
    """
    if param.dim() == 1 and role == "lm_head":
        return 0
    if param.dim() != 2:
        return None
    if role in _ID_INDEXED_ROLES:
        return 0
    if role == LORA_EMBEDDING_ROLE:
        parts = name.split(".")
        if "lora_embedding_A" in parts:
            return 1
        if "lora_B" in parts or _TRAINABLE_TOKENS in parts:
            return 0
    return None


def rows_view(tensor: Tensor, transposed: bool = False) -> Tensor:
    """The (ids x width) view of a rows-flooded tensor: its transpose when the ids index the columns
    (``rows_axis`` 1), one row of width 1 per id for a vocabulary vector. A view: flooding it in place
    floods the tensor."""
    if transposed:
        return tensor.t()
    return tensor.unsqueeze(1) if tensor.dim() == 1 else tensor


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
    def rows_axis(self) -> int | None:
        """The axis a rows flood runs along (0: ids index rows, 1: columns), None when not id-indexed."""
        return rows_axis_of(self.name, self.param, self.role)

    @property
    def flooded(self) -> bool:
        return self.trainable and not self.clean and self.treatment.kind != "frozen"

    @property
    def flood_mode(self) -> str:
        """"rows" (a rows treatment along the token axis) or "matrix" (a factor with no token axis too)."""
        return "rows" if self.treatment.kind == "rows" and self.rows_axis is not None else "matrix"

    @property
    def transposed(self) -> bool:
        """Its rows flood runs along the columns (the token ids index the second axis)."""
        return self.flood_mode == "rows" and self.rows_axis == 1

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


def _lora_vocab_factor(name: str, param: nn.Parameter, chain: list[nn.Module], head: nn.Module | None) -> bool:
    """Whether ``name`` is a peft LoRA factor of an nn.Embedding or of the output embedding.

    peft's embedding LoRA adds ``s * B @ A[:, x_t]`` to token t's embedding (A: r x V, B: d x r). With
    g_t the gradient at token t's embedding output:
      * dA[:, v] = s * B^T * sum_{t: x_t = v} g_t is non-zero exactly in the input tokens' columns: the bag
        of input tokens is read off the top column norms (the attack), so A needs the rows flood on axis 1;
      * dB = s * sum_t g_t A[:, x_t]^T (d x r) is dense, yet its row space lies in span{A[:, x_t]} of the
        input tokens: once A is non-zero (peft starts it at 0; training makes the seen tokens' columns
        non-zero) and the batch has fewer distinct tokens than r, each vocabulary column A[:, v] can be
        tested against that span (a DAGER-style membership test); its column space is span{g_t}, as in an
        MLP gradient. It is not token-indexed (rows_axis None) but leaks as much as the embedding, so it
        gets the same role: a matrix flood at the embedding's strength, not the weak 'other' one.
    LoRA on the output embedding (``lora_B``: V x r, row v feeds logit v; ``lora_A``: r x d, dense) is the
    transpose of the same picture and gets the same role (rows_axis 0 for B, None for A). So does peft's
    ``trainable_tokens_delta`` (rows of chosen tokens of the embedding; rows_axis 0).
    """
    parts = name.split(".")
    if _TRAINABLE_TOKENS in parts and param.dim() == 2:
        return True
    for i, part in enumerate(parts[:-1]):
        if part not in _LORA_EMBEDDING_PARTS + _LORA_LINEAR_PARTS:
            continue
        layer = chain[i]  # chain[0] is the root: chain[i] owns attribute parts[i]
        base = getattr(layer, "base_layer", None)
        if base is None:
            continue
        if part in _LORA_EMBEDDING_PARTS and isinstance(base, nn.Embedding):
            vocab = base.num_embeddings
            axis = 1 if part == "lora_embedding_A" else 0  # A: (r, V); B: (d, r)
            expected = vocab if part == "lora_embedding_A" else base.embedding_dim
            if param.dim() != 2 or param.shape[axis] != expected:  # fail closed if peft's layout changes
                raise ValueError(
                    f"{name}: shape {tuple(param.shape)} is not peft's embedding-LoRA layout (A: r x "
                    f"{vocab}, B: {base.embedding_dim} x r); name its role with AegisConfig(role_overrides=...)"
                )
            return True
        if part in _LORA_LINEAR_PARTS and head is not None:
            head_weight = getattr(head, "weight", None)
            if layer is head or (head_weight is not None and getattr(base, "weight", None) is head_weight):
                return True
    return False


def _lora_linear_factor(name: str, chain: list[nn.Module]) -> str | None:
    """The path of the adapted module when ``name`` is a peft LoRA factor (lora_A / lora_B) of a Linear or
    Conv1D layer, else None."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in _LORA_LINEAR_PARTS and getattr(chain[i], "base_layer", None) is not None:
            return ".".join(parts[:i])
    return None


def _vocabulary_vector(model: nn.Module, name: str, param: nn.Parameter, head: nn.Module | None) -> bool:
    """The output embedding's bias (entry v feeds logit v), or a 1-D parameter of ``vocab_size`` entries
    outside the transformer blocks (inside them that length is a hidden size that happens to match)."""
    if param.dim() != 1:
        return False
    if head is not None and param is getattr(head, "bias", None):
        return True
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab is not None and param.shape[0] == vocab and not _BLOCK_PATH.search(name)


def _label_indexed(model: nn.Module, param: nn.Parameter) -> bool:
    """A head weight whose rows are the labels' (C x d): the head's output layer, not a hidden transform."""
    if param.dim() != 2:
        return True  # a 1-D head parameter that is not a bias: keep the head's treatment
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    outputs, inputs = param.shape
    return outputs == labels or 8 * outputs <= inputs


def detect_role(model: nn.Module, name: str, param: nn.Parameter, overrides: list[tuple[re.Pattern, str]]) -> str:
    for pattern, role in overrides:
        if pattern.search(name):
            return role
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embeddings = get_input() if callable(get_input) else None
    head = get_output() if callable(get_output) else None
    if embeddings is not None and param is getattr(embeddings, "weight", None):
        return "token_embedding"
    if head is not None and param is getattr(head, "weight", None):
        return "lm_head"
    if _vocabulary_vector(model, name, param, head):
        return "lm_head"
    chain = _module_path(model, name)
    if _lora_vocab_factor(name, param, chain, head):
        return LORA_EMBEDDING_ROLE
    owner, leaf = chain[-1], name.rsplit(".", 1)[-1]
    classes = [type(m).__name__ for m in chain[1:]]
    path = name.rsplit(".", 1)[0] if "." in name else ""
    if _NORM_CLASS.search(type(owner).__name__):
        return "norm"
    attention = any(_ATTENTION_CLASS.search(c) for c in classes) or bool(_ATTENTION_PATH.search(path))
    adapter = _lora_linear_factor(name, chain)
    if adapter is not None and (attention or _MLP_PATH.search(adapter) or
                                any(_MLP_CLASS.search(c) for c in classes)):
        return "attention_lora" if attention else "mlp_lora"
    if attention:
        return "attention"
    if _DORA_MAGNITUDE in name.split("."):
        return "norm"
    if isinstance(owner, nn.Embedding):
        return "position_embedding"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "bias"
    if param.dim() >= 2 and _TOKEN_DENSE_PATH.search(path):
        return "mlp"
    if _HEAD_PATH.search(path) or owner is head:
        return "head" if _label_indexed(model, param) else "mlp"
    if param.dim() >= 2 and (any(_MLP_CLASS.search(c) for c in classes) or _MLP_PATH.search(path)):
        return "mlp"
    return "other"


def _module_class(model: nn.Module, name: str) -> str:
    """The class of the module owning ``name`` and of its enclosing block (containers skipped)."""
    chain = _module_path(model, name)
    real = [m for m in chain if not isinstance(m, _CONTAINERS)]
    if len(real) >= 2 and real[-1] is chain[-1]:
        return f"{type(real[-1]).__name__} in {type(real[-2]).__name__}"
    return type(real[-1]).__name__


def _unknown_message(model: nn.Module, unknown: list[str], config: AegisConfig) -> str:
    shown = ", ".join(f"{n!r} ({_module_class(model, n)})" for n in unknown[:10])
    more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
    roles = ", ".join(repr(r) for r in ROLES if r != "other")
    example = "^" + re.escape(unknown[0]) + "$"
    other = config.treatments.get("other")
    weak = f" (lam {other.lam}, rho {other.rho})" if other is not None and other.kind != "frozen" else ""
    return (
        f"AEGIS does not know the role of {len(unknown)} trainable parameter(s): {shown}{more}. "
        f"Fix: name their role with AegisConfig(role_overrides={{regex: role}}), e.g. "
        f"role_overrides={{r\"{example}\": \"mlp\"}}, with role one of {roles}; "
        f"or pass strict=False to accept the weak 'other' flood{weak} for them."
    )


# Roles whose gradient rows are indexed by token or label: a clean one gives the batch's bag of tokens or labels.
INDEXED_ROLES = frozenset({"token_embedding", "token_embedding_lora", "lm_head", "head"})


def _allow_listed(name: str, role: str, patterns: list[tuple[str, re.Pattern]]) -> bool:
    """``allow_clean`` entries match whole parameter names; a token- or label-indexed parameter only by its
    exact name, with a warning."""
    matched = [text for text, pattern in patterns if pattern.fullmatch(name)]
    if not matched:
        return False
    if role in INDEXED_ROLES:
        if name not in matched:
            raise ValueError(
                f"allow_clean pattern(s) {matched} match {name} (role {role!r}), whose clean gradient gives the "
                f"batch's bag of tokens or labels: list it by its exact name, allow_clean=({name!r},), if you "
                "mean it, or narrow the pattern"
            )
        warnings.warn(f"allow_clean exports {name} (role {role!r}) unflooded: its gradient rows tell the server "
                      "which tokens or labels the batch holds", stacklevel=4)
    return True


def plan(model: nn.Module, config: AegisConfig) -> list[ParamPlan]:
    """Classify every parameter of ``model``; raise (strict) or warn on unknown trainable ones."""
    params = list(model.named_parameters())
    if not params:
        raise ValueError("the model has no parameters: pass the model you train (e.g. a transformers PreTrainedModel)")
    overrides = [(re.compile(p), r) for p, r in config.role_overrides.items()]
    clean = [(p, re.compile(p)) for p in config.allow_clean]
    treatments = config.treatments
    plans = []
    for name, param in params:
        role = detect_role(model, name, param, overrides)
        if role not in treatments:
            raise ValueError(
                f"{name} has role {role!r}, which the preset gives no treatment: add it to the preset "
                f"(AegisConfig(preset={{..., {role!r}: Treatment(...)}})) or overrides"
            )
        plans.append(
            ParamPlan(
                name=name,
                param=param,
                role=role,
                treatment=treatments[role],
                trainable=param.requires_grad,
                clean=_allow_listed(name, role, clean),
            )
        )
    unknown = [p.name for p in plans if p.role == "other" and p.trainable]
    if unknown:
        message = _unknown_message(model, unknown, config)
        if config.strict:
            raise ValueError(message + " (strict=True)")
        warnings.warn(message, stacklevel=3)
    return plans
