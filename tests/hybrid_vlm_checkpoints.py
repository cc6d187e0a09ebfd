"""A tiny random Qwen3.5 image-text checkpoint (`Qwen3_5ForConditionalGeneration`) made with
transformers, with the processor files a Qwen3.5 release carries, and transformers' processor
over it (the reference's inputs), so that preprocessing, positions, the vision tower and the
hybrid text model can be checked against transformers without a download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.checkpoints import make_tokenizer

#: Qwen3.5's chat template reduced to what these tests send (user turns of text and image
#: parts, no tools, no thinking): an image part renders as the release's
#: "<|vision_start|><|image_pad|><|vision_end|>", which the processor expands
QWEN35_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN35_VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: Qwen/Qwen3.5's preprocessor_config.json (Qwen3-VL's): Qwen2-VL's image processor with 16 px
#: patches merged 2 x 2, 256 x 256 to 4096 x 4096 pixels, mean and std 0.5
QWEN35_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
#: a tower of Qwen3.5's 16 px patches merged 2 x 2, two blocks, a 48 x 48 learned position table
QWEN35_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                     spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=2304,
                     hidden_act="gelu_pytorch_tanh", initializer_range=0.2)


def _qwen35_tokenizer(path: Path) -> Any:
    """make_tokenizer's Qwen2 BPE plus the vision tokens (special added tokens), with the template."""
    from tokenizers import AddedToken, Tokenizer

    make_tokenizer(path, family="qwen3_5")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in QWEN35_VISION_SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": QWEN35_CHAT_TEMPLATE, "model_max_length": 4096,
    }))
    return tok


def qwen35_vl_processor(path: Path) -> Any:
    """transformers' Qwen3VLProcessor (what Qwen3.5 folders name) over the folder's tokenizer
    and image processor (the Pil one), without its video half: the video processor's class
    needs torchvision, and images never reach it."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    class ImagesOnly(transformers.Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly(image_processor, tokenizer, None, chat_template=QWEN35_CHAT_TEMPLATE)


def make_qwen35_vl_checkpoint(path: Path, seed: int = 0, moe: bool = False) -> Path:
    """Save a tiny random Qwen3.5 image-text checkpoint in `path`: a hybrid text model of
    four layers (linear, full, linear, full), head_dim 32 with half of it rotary (8 pairs,
    interleaved M-RoPE sections [3, 3, 2], so all three streams rotate some pairs); the
    tower of QWEN35_VISION; random biases and norm weights (HF inits them to 0 or 1, which
    would hide those paths), q and k norms of about 3 so attention is sharp enough that
    wrong image positions change the greedy tokens (with 1 they do not); and the release's
    preprocessor_config.json. `moe`: Qwen3.5-MoE's (`Qwen3_5MoeForConditionalGeneration`), the
    same tower over a text model whose every MLP is 8 experts of width 32, 2 a token, and a
    shared expert of width 48."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = _qwen35_tokenizer(path)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=16,
                linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=4,
                max_position_embeddings=1024, initializer_range=0.2, eos_token_id=eos, pad_token_id=pad,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    if moe:
        text.update(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    cfg = getattr(transformers, family + "Config")(text_config=text, vision_config=dict(QWEN35_VISION),
                                     image_token_id=tok.token_to_id("<|image_pad|>"),
                                     video_token_id=tok.token_to_id("<|video_pad|>"),
                                     vision_start_token_id=tok.token_to_id("<|vision_start|>"),
                                     vision_end_token_id=tok.token_to_id("<|vision_end|>"),
                                     tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, family + "ForConditionalGeneration")(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "visual" in name and "norm" in name and name.endswith(".weight"):
                param.normal_(1.0, 0.2)  # LayerNorms: 1-centred
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(2.0, 0.3)  # sharp attention (scores x ~9): its positions matter to the tokens
            elif name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)  # the text model's (1 + w) norms
            elif name.endswith("pos_embed.weight"):
                param.normal_(0.0, 0.5)
    model.config.architectures = [family + "ForConditionalGeneration"]
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN35_PREPROCESSOR, indent=2))
    return path
