"""Tiny random-weight Pi0 / Pi0.5 checkpoints made with transformers, in the Hub's folder layout
(config.json, model.safetensors, tokenizer files, processor_config.json with the image
processor's settings and the dataset statistics), and the reference that serves them:
`PI0ForConditionalGeneration.sample_actions` fed by `PI0Processor`.

PI0's image processor is a torchvision backend, and torchvision does not load here; the
reference uses the same settings on transformers' Pillow backend (`PI0ImageProcessorPil`),
which is what mstar reproduces (resize keeping the aspect ratio, bicubic, then pad).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.checkpoints import make_tokenizer

IMAGE_SIZE = 28
PATCH = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2
STATE_DIM = 5  # the robot's state (the dataset's), zero-padded to max_state_dim
MAX_DIM = 8
CHUNK = 5
STEPS = 4
TEXT = dict(model_type="gemma", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
DIT = dict(model_type="gemma", hidden_size=24, num_hidden_layers=2, intermediate_size=48, num_attention_heads=2,
           num_key_value_heads=1, head_dim=16)


def pil_image_processor_class() -> Any:
    """PI0ImageProcessor's settings on the Pillow backend (its own class needs torchvision)."""
    from transformers.image_processing_backends import PilBackend
    from transformers.models.pi0.image_processing_pi0 import PI0ImageProcessor

    names = ("resample", "image_mean", "image_std", "size", "default_to_square", "do_resize", "do_rescale",
             "do_normalize", "do_convert_rgb", "image_seq_length", "pad_size", "do_pad")
    attrs = {n: getattr(PI0ImageProcessor, n) for n in names}
    attrs["model_input_names"] = PI0ImageProcessor.model_input_names
    return type("PI0ImageProcessorPil", (PilBackend,), attrs)


#: family -> (config class, model class, processor class)
FAMILIES = {"pi0": ("PI0Config", "PI0ForConditionalGeneration", "PI0Processor"),
            "pi05": ("PI05Config", "PI05ForConditionalGeneration", "PI05Processor")}
STATS = ("state_mean", "state_std", "actions_mean", "actions_std", "state_q01", "state_q99", "actions_q01",
         "actions_q99")


def make_processor(path: Path, family: str = "pi0", **stats: Any) -> Any:
    """The family's processor over the folder's tokenizer, with the Pillow image processor."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    images = pil_image_processor_class()(size={"max_height": IMAGE_SIZE, "max_width": IMAGE_SIZE},
                                         pad_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                         image_seq_length=TOKENS_PER_IMAGE)
    cls = getattr(transformers, FAMILIES[family][2])
    return cls(images, tok, max_state_dim=MAX_DIM, chunk_size=CHUNK, **stats)


def load_processor(path: Path) -> Any:
    """The reference processor of a folder made here: its saved statistics and tokenizer."""
    saved = json.loads((path / "processor_config.json").read_text())
    family = "pi05" if saved.get("processor_class") == "PI05Processor" else "pi0"
    return make_processor(path, family, **{k: saved[k] for k in STATS if k in saved})


def statistics(family: str, seed: int) -> dict[str, list[float]]:
    """The dataset statistics a processor normalizes the state with: mean and std (Pi0),
    the 1st and 99th percentiles (Pi0.5, mapped to [-1, 1])."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    if family == "pi05":
        low = (torch.rand(STATE_DIM, generator=gen) - 1.5).tolist()
        return dict(state_q01=low, state_q99=[v + 3.0 for v in low], actions_q01=[-1.0] * STATE_DIM,
                    actions_q99=[1.0] * STATE_DIM)
    return dict(state_mean=(torch.randn(STATE_DIM, generator=gen) * 0.5).tolist(),
                state_std=(torch.rand(STATE_DIM, generator=gen) + 0.5).tolist(),
                actions_mean=[0.0] * STATE_DIM, actions_std=[1.0] * STATE_DIM)


def make_pi0_checkpoint(path: Path, seed: int = 0, cameras: tuple[str, ...] = (), family: str = "pi0") -> Path:
    """Save a tiny random PI0ForConditionalGeneration (or PI05ForConditionalGeneration)
    with its processor in `path`; `cameras`: LeRobot's `input_features` in config.json
    (the cameras the model needs)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, extra_specials=("<bos>",))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<bos>"}))
    processor = make_processor(path, family, **statistics(family, seed))
    processor.save_pretrained(path)
    vocab = len(processor.tokenizer)
    config_name, model_name, _ = FAMILIES[family]
    dims = dict(max_state_dim=MAX_DIM) if family == "pi0" else {}
    cfg = getattr(transformers, config_name)(
        vlm_config=dict(model_type="paligemma", text_config={**TEXT, "vocab_size": vocab}, vision_config=VISION,
                        projection_dim=TEXT["hidden_size"], image_token_id=processor.image_token_id,
                        vocab_size=vocab),
        dit_config=DIT, chunk_size=CHUNK, max_action_dim=MAX_DIM, num_inference_steps=STEPS, **dims)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random biases and norm weights, so those paths are exercised
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:  # (Pi0.5's adaptive norms start at zero)
                param.normal_(0.0, 0.2)
    model.config.architectures = [model_name]
    model.save_pretrained(path, safe_serialization=True)
    if cameras:
        config = json.loads((path / "config.json").read_text())
        config["input_features"] = {f"observation.images.{name}": {"type": "VISUAL", "shape": [3, 224, 224]}
                                    for name in cameras}
        config["input_features"]["observation.state"] = {"type": "STATE", "shape": [STATE_DIM]}
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def reference_actions(path: Path, images: list[list[Any]], prompts: list[str], states: list[list[float]],
                      noise: Any) -> Any:
    """transformers' actions [B, chunk, max_action_dim] for a batch (one list of images a sample)."""
    import torch
    import transformers

    processor = load_processor(path)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(images=images, text=prompts, state=torch.tensor(states, dtype=torch.float32))
    extra = {"state": inputs["state"]} if "state" in inputs else {}
    with torch.no_grad():
        return model.sample_actions(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                                    attention_mask=inputs["attention_mask"],
                                    pixel_attention_mask=inputs["pixel_attention_mask"], noise=noise, **extra)
