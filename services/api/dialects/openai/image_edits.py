"""`POST /v1/images/edits` (OpenAI's image edit API) for an image model that edits (BAGEL:
its inferencer's `interleave_inference([image, prompt])`).

Body: OpenAI's multipart/form-data: the image to edit as an `image` part (or `image[]`, as
the official client sends a list), `prompt`, `n`, `size`, `response_format` (b64_json),
`output_format`, `model`, `user`; the generations route's extensions (`seed`,
`num_inference_steps`, `guidance_scale`) plus `image_guidance_scale` (BAGEL's
`cfg_img_scale`: the pull toward the input image). Reply as the generations route's
(`images.ImagesResponse`), from the same code (`images.images_prepared`).

Refusals, each a 400 naming the field before anything is queued: a model that does not
edit (Cosmos 3, a text model) names the model and this route (`model`); a body that is
not a form, no image part, more than one image, a part Pillow cannot read as an image
(`image`); a `mask` (BAGEL edits by its prompt alone: `mask`); and what the generations
route refuses (`size`, `n`, `num_inference_steps`, ...).

The edit itself is not yet on the engine: the input image's ViT rows and autoencoder
latents in each guidance branch's context (full, no text, no image) are the part left
(the encoder is `modeling/vision/flux_ae.FluxEncoder`), so a request that passes every
check above is answered with a 400 naming `image` that says so, rather than queued.
"""

from __future__ import annotations

import io
from typing import Annotated, Any

from msgspec import Meta

from services.api.dialects.openai.images import ImageGenerationRequest, check_served, engine_options, parse_size
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
    if settings.task != "image" or not settings.image_edits:
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


def accept(form: EditForm, state: ApiState) -> Prepared:
    settings = state.settings
    req = load(form.fields, ImageEditRequest)
    check_edits(req, settings)
    read_image(form.images)
    if req.size != "auto":
        parse_size(req.size, settings)
    engine_options(req, settings, 0, 0, 1)  # the steps' cap, as the generations route checks it
    raise invalid("image", f"editing images with {settings.model_name!r} is not yet served: the input image's rows "
                           f"in the guidance branches' contexts are not on the engine yet (the route, its checks "
                           f"and the autoencoder's encoder are)")
