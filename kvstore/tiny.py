"""Tiny random-weight mlx-lm models with a locally trained tokenizer: the demo's and tests' default.

Nothing is downloaded: the BPE tokenizer is trained on a few lines of text and the weights are
random, so the KV caches are real mlx-lm caches of real architectures, only small.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

# One ChatML-style template that renders tools into the system turn, as Qwen's does.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% set start = 1 if messages[0]['role'] == 'system' else 0 %}"
    "{% else %}{% set start = 0 %}{% endif %}"
    "{% for m in messages[start:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "You are a careful assistant. Classify the request, reason with tools, examine the answer,",
    "and synthesize a final reply for the user. Return JSON with the fields category and reason.",
    "The quick brown fox jumps over the lazy dog. Tools: search, calculator, calendar, weather.",
    "system user assistant tool function name description parameters properties type string",
    "0123456789 {}[]():;,.!?-_'\"/ the of and to in is that for it as with was on be at by",
]

# Architectures covering the cache families: plain KV, hybrid linear attention, sliding window.
ARCHITECTURES: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # a head dim that kv_bits group sizes (32, 64) divide
        rms_norm_eps=1e-5,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            model_type="qwen3_5_text",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            full_attention_interval=2,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        vocab_size=512,
        sliding_window=64,
        sliding_window_pattern=3,
    ),
    # every other state layout mlx-lm builds: SSM, linear attention, short convolutions, recurrent
    # blocks with a local attention window, each with the KV layers its family mixes in
    "mamba": dict(
        model_type="mamba",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=8,
        tie_word_embeddings=True,
    ),
    "mamba2": dict(
        model_type="mamba2",
        num_heads=4,
        head_dim=32,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        state_size=16,
        num_hidden_layers=2,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=[0.0, 100.0],
        time_step_rank=8,
    ),
    "lfm2": dict(
        model_type="lfm2",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        full_attn_idxs=[1],
        layer_types=["conv", "full_attention", "conv"],
    ),
    "falcon_h1": dict(
        model_type="falcon_h1",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_expand=1,
        mamba_chunk_size=32,
    ),
    "recurrent_gemma": dict(
        model_type="recurrent_gemma",
        attention_bias=False,
        conv1d_width=4,
        hidden_size=64,
        intermediate_size=128,
        logits_soft_cap=30.0,
        num_attention_heads=4,
        num_hidden_layers=3,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_window_size=64,
        vocab_size=512,
        block_types=["recurrent", "recurrent", "attention"],
        lru_width=64,
        head_dim=16,
    ),
    "nemotron_h": dict(
        model_type="nemotron_h",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=4096,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=8,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern="M*-",
        num_hidden_layers=3,
        head_dim=16,
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        embedding_multiplier=1.0,
        attention_multiplier=0.25,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        layer_types=["mamba", "attention"],
        rms_norm_eps=1e-5,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_expand=1,
        mamba_chunk_size=32,
        num_local_experts=0,
        num_experts_per_tok=0,
        shared_intermediate_size=128,
        position_embedding_type="rope",
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rms_norm_eps=1e-6,
        vocab_size=512,
        num_key_value_heads=2,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        head_dim=16,
        full_attention_interval=2,
        tie_word_embeddings=True,
    ),
    "kimi_linear": dict(
        model_type="kimi_linear",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        linear_attn_config=dict(
            kda_layers=[1], full_attn_layers=[2], num_heads=4, head_dim=16, short_conv_kernel_size=4
        ),
        model_max_length=4096,
        num_experts=4,
        moe_intermediate_size=64,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts_per_token=2,
        first_k_dense_replace=1,
        tie_word_embeddings=True,
    ),
}


def write_tokenizer(
    path: str | Path,
    *,
    chat_template: str = CHAT_TEMPLATE,
    special_tokens: list[str] | None = None,
    added_tokens: list[str] | None = None,
    bos_token: str | None = None,
    eos_token: str = "<|im_end|>",
    pad_token: str | None = None,
    add_bos: bool = False,
    corpus: list[str] | None = None,
) -> Path:
    """Train a byte-level BPE tokenizer on a few lines and save it with a chat template.

    The defaults give the ChatML tokenizer. A real model family's tokenizer is imitated by naming
    its control tokens (`special_tokens`), its non-special added tokens (`added_tokens`, e.g.
    Qwen's `<think>`), its BOS/EOS/pad, whether encoding prepends BOS (`add_bos`), and extra
    corpus lines so the words a test renders stay a few tokens long.
    """
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if pad_token is None and special_tokens is None:
        pad_token = "<|endoftext|>"
    specials = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
    for token in (bos_token, eos_token, pad_token):
        if token is not None and token not in specials:
            specials.append(token)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_CORPUS + list(corpus or [])) * 4, trainer)
    if added_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    if add_bos:
        if bos_token is None:
            raise ValueError("add_bos=True needs a bos_token")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A",
            pair=f"{bos_token} $A {bos_token} $B",
            special_tokens=[(bos_token, tok.token_to_id(bos_token))],
        )
    named = dict(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, **{k: v for k, v in named.items() if v is not None}
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return path


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    chat_template: str = CHAT_TEMPLATE,
    tokenizer: dict | None = None,
    sizes: dict | None = None,
    bits: int | None = None,
) -> Path:
    """Write a random-weight mlx-lm model directory (config, safetensors, tokenizer) to `path`.

    `tokenizer` holds extra `write_tokenizer` arguments (a family's control tokens, BOS, corpus).
    `sizes` replaces size parameters of the architecture's config (in its text_config where it has
    one), e.g. a qwen3_5 at a real model's shapes; `bits` quantizes the weights as mlx-lm's
    convert does from a bfloat16 checkpoint (affine, group size 64; what stays unquantized, and
    so the activations and the KV cache, in bfloat16), before they are first evaluated.
    """
    from mlx_lm.utils import quantize_model, save_model

    from kvstore import mlxlm

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    path = Path(path)
    config = json.loads(json.dumps(ARCHITECTURES[arch]))  # a copy: sizes edit it
    (config["text_config"] if "text_config" in config else config).update(sizes or {})
    model_class, args_class = mlxlm.model_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if bits:
        model.set_dtype(mx.bfloat16)
        model, config = quantize_model(model, config, 64, bits)
    mx.eval(model.parameters())
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, chat_template=chat_template, **(tokenizer or {}))
    return path
