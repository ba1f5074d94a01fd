"""Tiny random-weight models of the causal-LM architectures of transformers 5.17, and what
`hf_paged_kv.enable` is expected to do with each.

The catalogue covers every architecture that a survey of transformers 5.17 found to work with a
custom attention function, as is or with adaptations, plus a representative set of the ones
hf_paged_kv refuses (no attention interface, no attention, hybrid, chunked or sparse layers,
attention sinks, multi-head latent attention, attention called other than once per layer,
cross-attention).

Every model is built from one shared size (`BASE`, plus `MOE` for mixture-of-experts configs):
a config receives the keys of these two that it declares (as a field or through its
`attribute_map`), then the entry's own overrides, which are passed as they are. The weight scale
(`initializer_range=0.3`) makes attention sharp, so that greedy tokens depend on which key goes
with which value and at which position.

    >>> from tiny_models import CATALOGUE, build
    >>> model = build("llama")        # fp32, eval mode, torch.manual_seed(0) before building
    >>> CATALOGUE["gpt_oss"].refused  # regex of the UnsupportedModelError message
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import transformers

PAD, BOS, EOS = 0, 1, 2
VOCAB = 128

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
            pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False, is_decoder=True)
# Mixture-of-experts sizes under the names the configs use (each config takes those it declares).
MOE = dict(moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
           num_experts_per_tok=2, moe_topk=2, moe_k=2, top_k_experts=2, n_shared_experts=1, num_shared_experts=1,
           moe_num_shared_experts=1, shared_expert_intermediate_size=32, shared_intermediate_size=32,
           expert_ffn_hidden_size=32, dense_intermediate_size=128, n_group=1, topk_group=1, first_k_dense_replace=1,
           num_dense_layers=1)

# Override fragments shared by several entries.
SLIDING = dict(sliding_window=8)  # shorter than the test prompts: the window really cuts
ALTERNATING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
SOFTCAP = dict(sliding_window=8, attn_logit_softcapping=2.0)  # small cap: ignoring it changes the tokens
MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=12)
DSA = dict(MLA, index_n_heads=2, index_head_dim=16, index_topk=8)  # DeepSeek sparse attention indexer

# Regexes of the refusal reasons (hf_paged_kv/integration/model_checks.py words them).
NO_INTERFACE = r"does not use transformers' attention interface"
ENCODER_DECODER = r"encoder-decoder"
SINKS = r"attention sinks"
MLA_SHAPES = r"keys .* and values .* of different shapes"
TWO_CALLS = r"calls attention 2 times in layer"


def layer_type(kind: str) -> str:
    """The refusal of a model with layers of this unsupported type."""
    return rf"layer types \[.*'{kind}'"


@dataclass(frozen=True)
class Tiny:
    model_class: str
    config_class: str
    overrides: dict = field(default_factory=dict)
    refused: str | None = None  # regex of the expected UnsupportedModelError message; None: supported
    reference: str | None = None  # attention of the DynamicCache baseline; None: the model's default (sdpa)
    config_attrs: dict = field(default_factory=dict)  # set on the config after construction
    prepare: Callable | None = None  # called on the built model

    @property
    def supported(self) -> bool:
        return self.refused is None


def _xmod_language(model):
    model.set_default_language("en_XX")  # X-MOD needs a default language adapter


_BLT_PART = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=64, max_position_embeddings=256, initializer_range=0.3)

CATALOGUE: dict[str, Tiny] = {
    # ------------------------------------------------ work with a custom attention function as is
    "afmoe": Tiny("AfmoeForCausalLM", "AfmoeConfig", ALTERNATING),
    "apertus": Tiny("ApertusForCausalLM", "ApertusConfig"),
    "arcee": Tiny("ArceeForCausalLM", "ArceeConfig"),
    "aria": Tiny("AriaTextForCausalLM", "AriaTextConfig"),
    "bitnet": Tiny("BitNetForCausalLM", "BitNetConfig"),
    "cohere": Tiny("CohereForCausalLM", "CohereConfig"),
    "cohere2": Tiny("Cohere2ForCausalLM", "Cohere2Config", ALTERNATING),
    "cohere2_moe": Tiny("Cohere2MoeForCausalLM", "Cohere2MoeConfig", ALTERNATING),
    "cohere_compass": Tiny("CohereCompassForCausalLM", "CohereCompassTextConfig", dict(
        ALTERNATING, rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
                                      for kind in ("sliding_attention", "full_attention")})),
    "ctrl": Tiny("CTRLLMHeadModel", "CTRLConfig", dict(dff=128)),
    "cwm": Tiny("CwmForCausalLM", "CwmConfig", SLIDING),
    "dbrx": Tiny("DbrxForCausalLM", "DbrxConfig", dict(  # d_model: the sub-configs copy it, not its alias
        d_model=64, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2})),
    "diffllama": Tiny("DiffLlamaForCausalLM", "DiffLlamaConfig", refused=TWO_CALLS),
    # its dynamic mask adds learned scores to the attention
    "doge": Tiny("DogeForCausalLM", "DogeConfig", refused=r"adds scores of its own to the attention"),
    "dots1": Tiny("Dots1ForCausalLM", "Dots1Config", SLIDING),
    "emu3": Tiny("Emu3ForCausalLM", "Emu3TextConfig"),
    "ernie4_5": Tiny("Ernie4_5ForCausalLM", "Ernie4_5Config"),
    "ernie4_5_moe": Tiny("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig"),
    "exaone4": Tiny("Exaone4ForCausalLM", "Exaone4Config", ALTERNATING),
    "exaone_moe": Tiny("ExaoneMoeForCausalLM", "ExaoneMoeConfig", ALTERNATING),
    "flex_olmo": Tiny("FlexOlmoForCausalLM", "FlexOlmoConfig"),
    "gemma": Tiny("GemmaForCausalLM", "GemmaConfig"),
    "gemma3": Tiny("Gemma3ForCausalLM", "Gemma3TextConfig", ALTERNATING),
    "gemma4": Tiny("Gemma4ForCausalLM", "Gemma4TextConfig",
                   dict(SLIDING, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)),
    "gemma4_unified": Tiny("Gemma4UnifiedForCausalLM", "Gemma4UnifiedTextConfig", SLIDING),
    "glm": Tiny("GlmForCausalLM", "GlmConfig"),
    "glm4": Tiny("Glm4ForCausalLM", "Glm4Config"),
    "glm4_moe": Tiny("Glm4MoeForCausalLM", "Glm4MoeConfig"),
    "gpt2": Tiny("GPT2LMHeadModel", "GPT2Config", dict(n_inner=128)),
    "gpt_bigcode": Tiny("GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(n_inner=128)),
    "granite": Tiny("GraniteForCausalLM", "GraniteConfig"),
    "granitemoe": Tiny("GraniteMoeForCausalLM", "GraniteMoeConfig"),
    "granitemoeshared": Tiny("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig"),
    "helium": Tiny("HeliumForCausalLM", "HeliumConfig"),
    "hunyuan_v1_dense": Tiny("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config"),
    "hunyuan_v1_moe": Tiny("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config"),
    "hy_v3": Tiny("HYV3ForCausalLM", "HYV3Config"),
    "hyperclovax": Tiny("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig"),
    "jais2": Tiny("Jais2ForCausalLM", "Jais2Config"),
    "kosmos2": Tiny("Kosmos2TextForCausalLM", "Kosmos2TextConfig", dict(ffn_dim=128)),
    "kosmos2_5": Tiny("Kosmos2_5TextForCausalLM", "Kosmos2_5TextConfig", dict(ffn_dim=128)),
    "laguna": Tiny("LagunaForCausalLM", "LagunaConfig", SLIDING),
    "llama": Tiny("LlamaForCausalLM", "LlamaConfig"),
    "llama4": Tiny("Llama4ForCausalLM", "Llama4TextConfig",
                   dict(attention_chunk_size=8, layer_types=["chunked_attention", "full_attention"]),
                   refused=layer_type("chunked_attention")),
    "mellum": Tiny("MellumForCausalLM", "MellumConfig", SLIDING),
    "minimax_m2": Tiny("MiniMaxM2ForCausalLM", "MiniMaxM2Config"),
    "ministral": Tiny("MinistralForCausalLM", "MinistralConfig", SLIDING),
    "ministral3": Tiny("Ministral3ForCausalLM", "Ministral3Config"),
    "mistral": Tiny("MistralForCausalLM", "MistralConfig", SLIDING),
    "mixtral": Tiny("MixtralForCausalLM", "MixtralConfig"),
    "mllama": Tiny("MllamaForCausalLM", "MllamaTextConfig"),
    "modernbert_decoder": Tiny("ModernBertDecoderForCausalLM", "ModernBertDecoderConfig",
                               dict(local_attention=16)),  # sliding window local_attention // 2 = 8
    "nanochat": Tiny("NanoChatForCausalLM", "NanoChatConfig"),
    "nemotron": Tiny("NemotronForCausalLM", "NemotronConfig"),
    "olmo": Tiny("OlmoForCausalLM", "OlmoConfig"),
    "olmo2": Tiny("Olmo2ForCausalLM", "Olmo2Config"),
    "olmo3": Tiny("Olmo3ForCausalLM", "Olmo3Config", ALTERNATING),
    "olmoe": Tiny("OlmoeForCausalLM", "OlmoeConfig"),
    "opt": Tiny("OPTForCausalLM", "OPTConfig", dict(ffn_dim=128)),
    "persimmon": Tiny("PersimmonForCausalLM", "PersimmonConfig"),
    "phi": Tiny("PhiForCausalLM", "PhiConfig"),
    "phi3": Tiny("Phi3ForCausalLM", "Phi3Config"),
    "phimoe": Tiny("PhimoeForCausalLM", "PhimoeConfig"),
    "qwen2": Tiny("Qwen2ForCausalLM", "Qwen2Config", SLIDING),
    "qwen2_moe": Tiny("Qwen2MoeForCausalLM", "Qwen2MoeConfig", SLIDING),
    "qwen3": Tiny("Qwen3ForCausalLM", "Qwen3Config", SLIDING),
    "qwen3_moe": Tiny("Qwen3MoeForCausalLM", "Qwen3MoeConfig", SLIDING),
    "seed_oss": Tiny("SeedOssForCausalLM", "SeedOssConfig"),
    "smollm3": Tiny("SmolLM3ForCausalLM", "SmolLM3Config"),
    "solar_open": Tiny("SolarOpenForCausalLM", "SolarOpenConfig"),
    "starcoder2": Tiny("Starcoder2ForCausalLM", "Starcoder2Config"),
    # ------------------------------- only naming / flag differences (no head_dim, no backend flag)
    "bert": Tiny("BertLMHeadModel", "BertConfig"),
    "bert_generation": Tiny("BertGenerationDecoder", "BertGenerationConfig"),
    "biogpt": Tiny("BioGptForCausalLM", "BioGptConfig"),
    "camembert": Tiny("CamembertForCausalLM", "CamembertConfig"),
    "data2vec": Tiny("Data2VecTextForCausalLM", "Data2VecTextConfig"),
    "electra": Tiny("ElectraForCausalLM", "ElectraConfig", dict(embedding_size=64)),
    "ernie": Tiny("ErnieForCausalLM", "ErnieConfig"),
    "gpt_neox": Tiny("GPTNeoXForCausalLM", "GPTNeoXConfig"),
    "roberta": Tiny("RobertaForCausalLM", "RobertaConfig"),
    "roberta_prelayernorm": Tiny("RobertaPreLayerNormForCausalLM", "RobertaPreLayerNormConfig"),
    "stablelm": Tiny("StableLmForCausalLM", "StableLmConfig"),
    "xlm_roberta": Tiny("XLMRobertaForCausalLM", "XLMRobertaConfig"),
    "xlm_roberta_xl": Tiny("XLMRobertaXLForCausalLM", "XLMRobertaXLConfig"),
    "xmod": Tiny("XmodForCausalLM", "XmodConfig", prepare=_xmod_language),
    # ------------------------------------- extra semantics: supported ones, then refused ones
    "gemma2": Tiny("Gemma2ForCausalLM", "Gemma2Config", SOFTCAP, reference="eager"),  # HF's sdpa ignores softcap
    "vaultgemma": Tiny("VaultGemmaForCausalLM", "VaultGemmaConfig", SOFTCAP, reference="eager"),
    "jetmoe": Tiny("JetMoeForCausalLM", "JetMoeConfig", dict(kv_channels=16)),  # expands K/V after update
    # KV sharing: its last two layers attend over the K/V an earlier layer's `update` returned in
    # this forward (PagedCache returns the new K/V), and store a copy of them under their own index.
    "gemma3n": Tiny("Gemma3nForCausalLM", "Gemma3nTextConfig", dict(
        SLIDING, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, laurel_rank=8,
        activation_sparsity_pattern=[0.0] * 4, altup_num_inputs=2)),
    "roc_bert": Tiny("RoCBertForCausalLM", "RoCBertConfig", dict(
        pronunciation_vocab_size=32, shape_vocab_size=32, pronunciation_embed_dim=16, shape_embed_dim=16)),
    "axk1": Tiny("AXK1ForCausalLM", "AXK1Config", MLA, refused=MLA_SHAPES),
    "deepseek_v2": Tiny("DeepseekV2ForCausalLM", "DeepseekV2Config", MLA, refused=MLA_SHAPES),
    "deepseek_v3": Tiny("DeepseekV3ForCausalLM", "DeepseekV3Config", MLA, refused=MLA_SHAPES),
    "glm4_moe_lite": Tiny("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", MLA, refused=MLA_SHAPES),
    "longcat_flash": Tiny("LongcatFlashForCausalLM", "LongcatFlashConfig",
                          dict(MLA, head_dim=8, num_layers=2, ffn_hidden_size=128), refused=MLA_SHAPES),
    "minicpm3": Tiny("MiniCPM3ForCausalLM", "MiniCPM3Config", MLA, refused=MLA_SHAPES),
    "mistral4": Tiny("Mistral4ForCausalLM", "Mistral4Config", MLA, refused=MLA_SHAPES),
    "youtu": Tiny("YoutuForCausalLM", "YoutuConfig", MLA, refused=MLA_SHAPES),
    "axk2": Tiny("AXK2ForCausalLM", "AXK2Config", DSA, refused=layer_type("deepseek_sparse_attention")),
    "deepseek_v32": Tiny("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(DSA, head_dim=8),
                         refused=layer_type("deepseek_sparse_attention")),
    "glm_moe_dsa": Tiny("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", dict(DSA, head_dim=8),
                        refused=layer_type("deepseek_sparse_attention")),
    "hy_v4": Tiny("HYV4ForCausalLM", "HYV4Config", DSA, refused=layer_type("deepseek_sparse_attention")),
    "minimax_m3_vl": Tiny("MiniMaxM3VLForCausalLM", "MiniMaxM3VLTextConfig", dict(
        index_n_heads=2, index_head_dim=16, rotary_dim=8, layer_types=["full_attention", "minimax_m3_sparse"],
        index_block_size=2, index_topk_blocks=2, index_local_blocks=1), refused=layer_type("minimax_m3_sparse")),
    "gpt_oss": Tiny("GptOssForCausalLM", "GptOssConfig", SLIDING, refused=SINKS),
    "granite_swa": Tiny("GraniteSWAForCausalLM", "GraniteSWAConfig", SLIDING, refused=SINKS),
    "granitemoe_swa": Tiny("GraniteMoeSWAForCausalLM", "GraniteMoeSWAConfig", SLIDING, refused=SINKS),
    "mimo_v2_flash": Tiny("MiMoV2FlashForCausalLM", "MiMoV2FlashConfig", dict(SLIDING, v_head_dim=12),
                          refused=SINKS),
    "hrm_text": Tiny("HrmTextForCausalLM", "HrmTextConfig", refused=r"calls attention"),  # re-runs its layers
    "blt": Tiny("BltForCausalLM", "BltConfig", dict(
        patch_in_forward=False, encoder_hash_byte_group_size=[2, 3], encoder_hash_byte_group_vocab=64,
        patcher_config=_BLT_PART, encoder_config=_BLT_PART, global_config=dict(_BLT_PART, hidden_size=64),
        decoder_config=dict(_BLT_PART, vocab_size=VOCAB, hidden_size_global=64)),
        config_attrs=dict(num_attention_heads=2, num_hidden_layers=1, hidden_size=32),
        refused=r"calls attention"),  # local encoder, global transformer and decoder share layer indices
    # ------------------------------------------------------------------- refused, from outside
    "bloom": Tiny("BloomForCausalLM", "BloomConfig", refused=NO_INTERFACE),  # ALiBi, hand-written attention
    "falcon": Tiny("FalconForCausalLM", "FalconConfig", dict(ffn_hidden_size=128, num_kv_heads=2),
                   refused=NO_INTERFACE),
    "gptj": Tiny("GPTJForCausalLM", "GPTJConfig", dict(n_inner=128, rotary_dim=8), refused=NO_INTERFACE),
    "codegen": Tiny("CodeGenForCausalLM", "CodeGenConfig", dict(n_inner=128, rotary_dim=8), refused=NO_INTERFACE),
    "gpt_neo": Tiny("GPTNeoForCausalLM", "GPTNeoConfig", dict(attention_types=[[["global", "local"], 1]],
                                                              window_size=8), refused=NO_INTERFACE),
    "mpt": Tiny("MptForCausalLM", "MptConfig", refused=NO_INTERFACE),
    "mamba": Tiny("MambaForCausalLM", "MambaConfig", dict(state_size=16, time_step_rank=8, expand=2, conv_kernel=4),
                  refused=layer_type("linear_attention")),  # no attention at all
    "jamba": Tiny("JambaForCausalLM", "JambaConfig", dict(
        mamba_d_state=16, mamba_expand=2, mamba_d_conv=4, mamba_dt_rank=8, use_mamba_kernels=False,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
        refused=layer_type("linear_attention")),
    "bamba": Tiny("BambaForCausalLM", "BambaConfig", dict(
        mamba_d_state=16, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2,
        mamba_d_conv=4, attn_layer_indices=[1]), refused=layer_type("linear_attention")),
    "qwen3_next": Tiny("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"]), refused=layer_type("linear_attention")),
    "lfm2": Tiny("Lfm2ForCausalLM", "Lfm2Config", dict(layer_types=["conv", "full_attention"]),
                 refused=layer_type("conv")),
    # The decoder of a seq2seq model: BartForCausalLM sets `is_encoder_decoder=False` on its config,
    # but every layer keeps a cross-attention that `encoder_hidden_states` switches on.
    "bart": Tiny("BartForCausalLM", "BartConfig", dict(decoder_ffn_dim=128, encoder_ffn_dim=128, decoder_layers=2,
                                                       decoder_attention_heads=4), refused=ENCODER_DECODER),
}

SUPPORTED = sorted(name for name, tiny in CATALOGUE.items() if tiny.supported)
REFUSED = sorted(name for name, tiny in CATALOGUE.items() if not tiny.supported)


def _resolve(arch: str, name: str):
    """A class by name: from `transformers`, else from the architecture's own modules (a few
    classes, e.g. Kosmos-2's text model, are not exported at the top level)."""
    found = getattr(transformers, name, None)
    if found is not None:
        return found
    for kind in ("modeling", "configuration"):
        module = importlib.import_module(f"transformers.models.{arch}.{kind}_{arch}")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"transformers has no class {name} for {arch}")


def _declared(config_class) -> set[str]:
    """The names a config class takes: its fields and the aliases of its `attribute_map`."""
    return {f.name for f in dataclasses.fields(config_class)} | set(getattr(config_class, "attribute_map", {}))


def config_kwargs(arch: str) -> dict:
    """BASE and MOE keys the config declares, then the entry's overrides. A shared key whose
    alias target the entry sets itself is left out (JetMoE's `head_dim` is `kv_channels`)."""
    tiny = CATALOGUE[arch]
    config_class = _resolve(arch, tiny.config_class)
    declared, aliases = _declared(config_class), getattr(config_class, "attribute_map", {})
    shared = {k: v for k, v in {**BASE, **MOE}.items() if k in declared and aliases.get(k) not in tiny.overrides}
    return shared | tiny.overrides


def build(arch: str, seed: int = 0):
    """The tiny fp32 model of `arch` in eval mode, with `torch.manual_seed(seed)` before its
    weights are drawn; its generation config pads with PAD."""
    tiny = CATALOGUE[arch]
    config = _resolve(arch, tiny.config_class)(**config_kwargs(arch))
    for name, value in tiny.config_attrs.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = _resolve(arch, tiny.model_class)(config).float().eval()
    if tiny.prepare is not None:
        tiny.prepare(model)
    if tiny.reference is not None:
        model.set_attn_implementation(tiny.reference)
    model.generation_config.pad_token_id = PAD
    return model
