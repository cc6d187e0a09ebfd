"""Tiny random-weight Idefics3 / SmolVLM checkpoints made with transformers: a model folder
with weights, tokenizer and the saved processor, so that image preprocessing, prompt expansion
and the vision tower can be checked against transformers without a download."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.checkpoints import make_tokenizer

# The families' own chat templates (HuggingFaceM4/Idefics3-8B-Llama3 and
# HuggingFaceTB/SmolVLM-Instruct on the Hub): an {"type": "image"} part renders as "<image>".
IDEFICS3_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'].capitalize()}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

#: the processors' token strings; SmolVLM reads them from the tokenizer's extra_special_tokens
IMAGE_TOKENS = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}
#: the real checkpoints carry every grid tag up to 6x6 (the processors' largest grid)
ROW_COL_TAGS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

#: (config class, model class, processor class, image processor module, chat template, bos)
FAMILIES = {
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", "Idefics3Processor",
                 "idefics3", IDEFICS3_CHAT_TEMPLATE, "<|begin_of_text|>"),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", "SmolVLMProcessor",
                "smolvlm", SMOLVLM_CHAT_TEMPLATE, "<|im_start|>"),
}

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=32, patch_size=8)
SCALE_FACTOR = 2
#: (image_size / patch_size)^2 / scale_factor^2 tokens per tile
IMAGE_SEQ_LEN = (VISION["image_size"] // VISION["patch_size"]) ** 2 // SCALE_FACTOR**2


def _add_image_tokens(path: Path, family: str) -> None:
    """Add the processor's tokens to tokenizer.json as special added tokens, and write a
    tokenizer_config.json with the family's eos (<end_of_utterance>) and chat template."""
    from tokenizers import AddedToken, Tokenizer

    _, _, _, _, template, bos = FAMILIES[family]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    names = [bos, *IMAGE_TOKENS.values(), *ROW_COL_TAGS]
    if family == "smolvlm":
        names.remove(bos)  # <|im_start|> is already one of make_tokenizer's specials
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<end_of_utterance>",
        "bos_token": None, "pad_token": "<|endoftext|>", "chat_template": template,
        "model_max_length": 1024,
    }
    if family == "smolvlm":  # as the Hub's SmolVLM tokenizer_config.json has them
        config["extra_special_tokens"] = dict(IMAGE_TOKENS)
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@contextlib.contextmanager
def smolvlm_without_torchvision() -> Iterator[None]:
    """Let SmolVLMProcessor be built where torchvision and num2words are missing. It checks its
    video processor against `transformers.VideoProcessorMixin`, which transformers' lazy module
    hands out as a dummy without torchvision (the real class imports fine), and refuses to start
    without num2words, which it only uses to spell a video's frame count. Images reach neither."""
    import transformers
    from transformers import video_processing_utils
    from transformers.models.smolvlm import processing_smolvlm

    saved = processing_smolvlm.num2words, transformers.__dict__.get("VideoProcessorMixin")
    if saved[0] is None:
        processing_smolvlm.num2words = str
    transformers.VideoProcessorMixin = video_processing_utils.VideoProcessorMixin
    try:
        yield
    finally:
        processing_smolvlm.num2words = saved[0]
        if saved[1] is None:
            del transformers.VideoProcessorMixin
        else:
            transformers.VideoProcessorMixin = saved[1]


def smolvlm_video_processor() -> Any:
    """SmolVLM's video processor, from its module: the top-level name is a dummy without
    torchvision, while the class itself only needs torchvision to process videos."""
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    return SmolVLMVideoProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})


def load_processor(path: Path) -> Any:
    """transformers' AutoProcessor for a folder made here; for SmolVLM, with the video
    processor handed in (AutoVideoProcessor cannot load one without torchvision); for
    Qwen2.5-VL, its processor built over the folder's image half (`qwen25_vl_processor`)."""
    import transformers

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type == "qwen2_5_vl":
        return qwen25_vl_processor(path)
    if model_type != "smolvlm":
        return transformers.AutoProcessor.from_pretrained(path)
    with smolvlm_without_torchvision():
        return transformers.AutoProcessor.from_pretrained(path, video_processor=smolvlm_video_processor())


def make_processor(path: Path, family: str, longest_edge: int = 64, tile: int = 32,
                   image_seq_len: int = IMAGE_SEQ_LEN) -> Any:
    """The family's processor over the tokenizer in `path`, with small tiles (by default
    32 px, up to 2x2 of them from a 64 px resize) so that splitting is exercised by tiny
    images."""
    import importlib

    import transformers

    _, _, proc_name, module, template, _ = FAMILIES[family]
    prefix = "Idefics3" if family == "idefics3" else "SmolVLM"
    images = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
    image_processor = getattr(images, f"{prefix}ImageProcessorPil")(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile})
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    kwargs: dict[str, Any] = dict(image_seq_len=image_seq_len, chat_template=template)
    if family == "idefics3":
        return transformers.Idefics3Processor(image_processor, tokenizer, **kwargs)
    with smolvlm_without_torchvision():
        return getattr(transformers, proc_name)(image_processor, tokenizer, smolvlm_video_processor(), **kwargs)


def make_idefics3_checkpoint(path: Path, family: str = "idefics3", seed: int = 0, *, text: dict | None = None,
                             vision: dict | None = None, longest_edge: int = 64, tile: int = 32,
                             initializer_range: float = 0.2, **overrides: Any) -> Path:
    """Save a tiny random Idefics3 (or SmolVLM) checkpoint in `path`: Llama text model, SigLIP
    vision tower of 32 px images in 8 px patches, pixel shuffle by 2, so 4 tokens per tile.
    `text` and `vision` change those configs' sizes (the bench's larger checkpoint),
    `longest_edge` and `tile` the processor's; `overrides` go to the top-level config."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path)
    _add_image_tokens(path, family)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg_name, model_name, _, _, _, _ = FAMILIES[family]
    eos, pad = tok.token_to_id("<end_of_utterance>"), tok.token_to_id("<|endoftext|>")
    text_cfg = dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=None, pad_token_id=pad,
                    initializer_range=initializer_range, tie_word_embeddings=False)
    text_cfg.update(text or {})
    vision_cfg = {**VISION, "initializer_range": initializer_range, **(vision or {})}
    common: dict[str, Any] = dict(text_config=text_cfg, vision_config=vision_cfg,
                                  scale_factor=SCALE_FACTOR, image_token_id=tok.token_to_id("<image>"),
                                  pad_token_id=pad, eos_token_id=eos, tie_word_embeddings=False)
    common.update(overrides)
    seq_len = (vision_cfg["image_size"] // vision_cfg["patch_size"]) ** 2 // common["scale_factor"] ** 2
    cfg = getattr(transformers, cfg_name)(**common)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random biases (HF inits them to zero), so the bias path is exercised
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, initializer_range)
    model.config.architectures = [model_name]
    model.save_pretrained(path, safe_serialization=True)
    make_processor(path, family, longest_edge, tile, seq_len).save_pretrained(path)
    return path


# -- Gemma 3 (Gemma3ForConditionalGeneration) ----------------------------------------------

#: Gemma 3's chat template (google/gemma-3-4b-it, tokenizer_config.json): an image part
#: renders as "<start_of_image>", which the processor expands to the image's full sequence
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
#: the tokenizer's image tokens, as the Hub's Gemma 3 tokenizer_config.json names them
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                       "eoi_token": "<end_of_image>"}
GEMMA3_SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", *GEMMA3_IMAGE_TOKENS.values()]
#: vision tower of 32 px images in 8 px patches: 16 patches, average-pooled 2 x 2 to 4 tokens
GEMMA3_VISION = dict(VISION, model_type="siglip_vision_model", vision_use_head=False)
GEMMA3_MM_TOKENS = 4


def _gemma3_tokenizer(path: Path) -> Any:
    """make_tokenizer's BPE plus Gemma's special tokens (special added tokens), newline runs
    as tokens of their own (as Gemma's vocabulary has them: the image sequence's newlines
    merge with the prompt's), and a post-processor that adds <bos> as Gemma's does (the
    chat template writes <bos> too, so a templated prompt is tokenized without it)."""
    from tokenizers import AddedToken, Tokenizer, processors

    make_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in GEMMA3_SPECIALS])
    tok.add_tokens([AddedToken(n, special=False, normalized=False) for n in ("\n\n\n\n", "\n\n\n", "\n\n")])
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", bos)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<|endoftext|>", "chat_template": GEMMA3_CHAT_TEMPLATE, "model_max_length": 1024,
        "add_bos_token": True, "extra_special_tokens": dict(GEMMA3_IMAGE_TOKENS),
    }))
    return tok


def make_gemma3_vlm_checkpoint(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Gemma 3 vision checkpoint in `path`: a Gemma 3 text model of two
    layers (one sliding, window 8, so prompts longer than it exercise the window; one
    full), head_dim 16; a SigLIP tower of 32 px images in 8 px patches pooled to 4 tokens
    per image; random biases and (1 + w) norm weights (HF inits them to 0, which would hide
    the offset); and the processor (Gemma3ImageProcessorPil at 32 px, image_seq_length 4).
    `overrides` go to the top-level config."""
    import torch
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path.mkdir(parents=True, exist_ok=True)
    tok = _gemma3_tokenizer(path)
    ids = {name: tok.token_to_id(token) for name, token in GEMMA3_IMAGE_TOKENS.items()}
    eos, bos, pad = tok.token_to_id("<eos>"), tok.token_to_id("<bos>"), tok.token_to_id("<|endoftext|>")
    text = dict(model_type="gemma3_text", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=bos,
                pad_token_id=pad, initializer_range=0.2, tie_word_embeddings=False)
    # an LM head of its own: a tiny random model with a tied head repeats its last token
    common: dict[str, Any] = dict(text_config=text, vision_config=dict(GEMMA3_VISION, initializer_range=0.2),
                                  mm_tokens_per_image=GEMMA3_MM_TOKENS, boi_token_index=ids["boi_token"],
                                  eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
                                  eos_token_id=eos, pad_token_id=pad, initializer_range=0.2,
                                  tie_word_embeddings=False)
    common.update(overrides)
    cfg = transformers.Gemma3Config(**common)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif (name.endswith("norm.weight") and "language_model" in name) or "mm_soft_emb_norm" in name:
                param.normal_(0.0, 0.3)
            elif name.endswith("mm_input_projection_weight"):
                param.normal_(0.0, 0.2)  # HF inits it to zeros: the image rows would all be 0
    model.config.architectures = ["Gemma3ForConditionalGeneration"]
    model.save_pretrained(path, safe_serialization=True)
    image_processor = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    transformers.Gemma3Processor(image_processor, tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE,
                                 image_seq_length=GEMMA3_MM_TOKENS).save_pretrained(path)
    return path


# -- Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) ---------------------------------------

#: Qwen2.5-VL's chat template (Qwen/Qwen2.5-VL-7B-Instruct, chat_template.json): an image part
#: renders as "<|vision_start|><|image_pad|><|vision_end|>"; the processor repeats the pad
QWEN25_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN25_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: a tower of 8 px patches merged 2 x 2 (16 px per image token), 32 px windows (2 x 2 tokens),
#: block 0 windowed and block 1 full; images resized to 16..144 patches (4..36 tokens)
QWEN25_VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=8,
                        spatial_merge_size=2, temporal_patch_size=2, window_size=32, out_hidden_size=64,
                        fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu")
QWEN25_VL_PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 96 * 96}


def _qwen25_vl_tokenizer(path: Path) -> Any:
    """make_tokenizer's Qwen2 BPE plus Qwen2.5-VL's vision tokens (special added tokens),
    with its chat template."""
    from tokenizers import AddedToken, Tokenizer

    make_tokenizer(path, family="qwen2")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in QWEN25_VL_SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": QWEN25_VL_CHAT_TEMPLATE, "model_max_length": 4096,
    }))
    return tok


def qwen25_vl_processor(path: Path, pixels: dict | None = None, patch_size: int = 8) -> Any:
    """Qwen2.5-VL's processor over the folder's tokenizer and image processor (the Pil one),
    built by hand: AutoProcessor would load its video processor, which needs torchvision.
    Images never reach the video half. A folder without preprocessor_config.json gets
    `pixels` (min / max pixels) and `patch_size`."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    saved = path / "preprocessor_config.json"
    if saved.exists():
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    else:
        image_processor = Qwen2VLImageProcessorPil(size=dict(pixels or QWEN25_VL_PIXELS), patch_size=patch_size)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    class ImagesOnly(transformers.Qwen2_5_VLProcessor):
        """Without a video processor (its class needs torchvision): only the check of its
        class is skipped; a call with videos would fail, one with images never reads it."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly(image_processor, tokenizer, None, chat_template=QWEN25_VL_CHAT_TEMPLATE)


def make_qwen25_vl_checkpoint(path: Path, seed: int = 0, *, text: dict | None = None, vision: dict | None = None,
                              pixels: dict | None = None, **overrides: Any) -> Path:
    """Save a tiny random Qwen2.5-VL checkpoint in `path`: a Qwen2 text model of two layers,
    hidden 64, 4 heads of 16 (2 KV heads), M-RoPE sections (2, 3, 3); the vision tower of
    QWEN25_VL_VISION; random biases and norm weights; and the processor's image settings
    (Qwen2VLImageProcessorPil, 8 px patches, 32x32 to 96x96 pixels) in
    preprocessor_config.json. `text`, `vision` and `pixels` change those sizes (the bench's
    larger checkpoint); `overrides` go to the top-level config."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = _qwen25_vl_tokenizer(path)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    text_defaults = dict(model_type="qwen2_5_vl_text", vocab_size=tok.get_vocab_size(), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=None,
                         pad_token_id=pad, initializer_range=0.2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    text_cfg = {**text_defaults, **(text or {})}
    vision_cfg = {**QWEN25_VL_VISION, "initializer_range": 0.2, **(vision or {})}
    common: dict[str, Any] = dict(text_config=text_cfg, vision_config=vision_cfg,
                                  image_token_id=tok.token_to_id("<|image_pad|>"),
                                  video_token_id=tok.token_to_id("<|video_pad|>"),
                                  vision_start_token_id=tok.token_to_id("<|vision_start|>"),
                                  vision_end_token_id=tok.token_to_id("<|vision_end|>"),
                                  eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)
    common.update(overrides)
    cfg = transformers.Qwen2_5_VLConfig(**common)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1, which would hide those paths
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight") \
                    or name.endswith("ln_q.weight"):
                param.normal_(1.0, 0.2)
    model.config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    model.save_pretrained(path, safe_serialization=True)
    # the image processor's settings as the Hub's checkpoints keep them (the processor's own
    # save_pretrained wants its video processor)
    qwen25_vl_processor(path, pixels, vision_cfg["patch_size"]).image_processor.save_pretrained(path)
    return path


def png_bytes(image: Any) -> bytes:
    """A PIL image as a PNG file's bytes (what a client uploads)."""
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()
