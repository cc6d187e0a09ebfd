"""`POST /v1/images/edits` (OpenAI's image edit API) for an image model that edits (BAGEL:
its inferencer's `interleave_inference([image, prompt])`).

Body: OpenAI's multipart/form-data: the image to edit as an `image` part (or `image[]`, as
the official client sends a list), `prompt`, `n`, `size`, `response_format` (b64_json),
`output_format`, `model`, `user`; the generations route's extensions (`seed`,
`num_inference_steps`, `guidance_scale`) plus `image_guidance_scale` (BAGEL's
`cfg_img_scale`: the pull toward the input image). Reply as the generations route's
(`images.ImagesResponse`), from the same code (`images.images_prepared`).

The edit's size is the input image's after the model's resize (BAGEL's VAE transform:
`settings.image_edit_resize`), as the reference makes it; `size` may be "auto" or that
size. Each of the `n` images is its own engine request, sample j of the seed, with the
image's file on it (`GenerateParams.images`): the data worker makes its pixels (the
spec's `prepare_image`), the worker its context (`modeling/vision/bagel_edit.py`).

Refusals, each a 400 naming the field before anything is queued: a model that does not
edit (Cosmos 3, a text model) names the model and this route (`model`); a body that is
not a form, no image part, more than one image, a part Pillow cannot read as an image
(`image`); a `mask` (BAGEL edits by its prompt alone: `mask`); a size other than the
edit's (`size`); and what the generations route refuses (`n`, `num_inference_steps`, ...).
"""

from __future__ import annotations

import io
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from services.api.dialects.openai.images import (
    ImageGenerationRequest,
    check_served,
    engine_options,
    images_prepared,
    sample_choices,
)
from services.api.errors import invalid
from services.api.forms import is_form, parse_form
from services.api.serving import Prepared
from services.api.settings import ApiSettings
from services.api.state import ApiState
from services.api.validation import load

ROUTE = "/v1/images/edits"
#: the form's file parts: the image (OpenAI's client sends `image`, or `image[]` for a list)
IMAGE_PARTS = ("image", "image[]")
FILE_PARTS = frozenset({*IMAGE_PARTS, "mask"})
#: images one edit takes (BAGEL's edit context holds one)
MAX_IMAGES = 1


class ImageEditRequest(ImageGenerationRequest):
    """The form's text fields (the image parts are apart: `EditForm`)."""

    image_guidance_scale: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None


class EditForm:
    """The decoded body: its typed text fields and its image parts' bytes, in order."""

    def __init__(self, fields: dict[str, Any], images: list[bytes]) -> None:
        self.fields, self.images = fields, images


def decode(body: bytes, content_type: str | None) -> EditForm:
    """The body as OpenAI's client sends it (a form); a 400 naming the part that is wrong."""
    if not is_form(content_type):
        raise invalid("image", f"{ROUTE} takes multipart/form-data with the image to edit as an 'image' part")
    form = parse_form(body, content_type, FILE_PARTS)
    if form.file is not None:
        raise invalid("file", "the image to edit is the form's 'image' part (or 'image[]'), not 'file'")
    if "mask" in form.files:
        raise invalid("mask", "mask is not taken: the served model edits by its prompt alone")
    images = [data for name in IMAGE_PARTS for data in form.files.get(name, [])]
    return EditForm({k: v for k, v in form.fields.items() if v is not None}, images)


def check_edits(req: ImageEditRequest, settings: ApiSettings) -> None:
    """An image model that edits, the one the body names (else 400 naming `model`)."""
    if settings.task != "image" or not settings.image_edit_resize:
        raise invalid("model", f"the served model {settings.model_name!r} does not edit images: {ROUTE} is for "
                               f"models that edit (BAGEL); it is a {settings.task!r} model")
    check_served(req, settings)


def read_image(images: list[bytes]) -> Any:
    """The one image to edit, decoded (Pillow, RGB); a 400 naming `image` for none, too
    many, or bytes that are not an image."""
    from PIL import Image, UnidentifiedImageError

    if not images:
        raise invalid("image", "an 'image' part (the image to edit) is required")
    if len(images) > MAX_IMAGES:
        raise invalid("image", f"at most {MAX_IMAGES} image may be edited per request, got {len(images)}")
    try:
        image = Image.open(io.BytesIO(images[0]))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise invalid("image", f"the 'image' part is not an image (PNG, JPEG, WebP, ...): {exc}") from None
    return image.convert("RGB")


def edit_size(image: Any, settings: ApiSettings, size: str) -> tuple[int, int]:
    """(width, height) of the edit: the input's after the model's resize; a 400 naming
    `size` for another."""
    from shared.vision.bagel import Resize

    width, height = Resize(*settings.image_edit_resize).size(*image.size)
    if size not in ("auto", f"{width}x{height}"):
        raise invalid("size", f"size must be \"auto\" or {width}x{height}: an edit is the size of its input image "
                              f"after the model's resize, got {size}")
    return width, height


def accept(form: EditForm, state: ApiState) -> Prepared:
    settings = state.settings
    req = load(form.fields, ImageEditRequest)
    check_edits(req, settings)
    width, height = edit_size(read_image(form.images), settings, req.size)
    options = engine_options(req, settings, width, height, 1)
    if req.image_guidance_scale is not None:
        options["image_guidance_scale"] = float(req.image_guidance_scale)
    image = form.images[0]
    choices = [c._replace(params=msgspec.structs.replace(c.params, images=(image,)))
               for c in sample_choices(req.prompt, options, req.n, req.request_id)]
    return images_prepared(req, choices, width, height)
