"""`POST /v1/images/edits`' checks that need no server: which served models edit (an image
model that does not, Cosmos 3, names itself and the route), and the form's parts."""

from __future__ import annotations

import pytest

from services.api.dialects.openai.image_edits import ImageEditRequest, check_edits, decode
from services.api.errors import ApiError
from services.api.settings import ApiSettings

BOUNDARY = "XyZ"


def _form(*parts: tuple[str, bytes]) -> tuple[bytes, str]:
    body = b"".join(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{n}"; filename="f"\r\n\r\n'.encode()
                    + data + b"\r\n" for n, data in parts) + f"--{BOUNDARY}--\r\n".encode()
    return body, f"multipart/form-data; boundary={BOUNDARY}"


@pytest.mark.parametrize("task,edits,ok", [("image", (), False), ("generate", (), False),
                                           ("image", (1024, 512, 16), True)])
def test_only_a_model_that_edits_is_served(task: str, edits: tuple[int, ...], ok: bool) -> None:
    settings = ApiSettings(model_name="cosmos3-tiny", api_addr="a", advertise_addr="a", data_worker_addr="d",
                           conductor_addr="c", control_addr="c", task=task, image_edit_resize=edits)
    req = ImageEditRequest(prompt="x")
    if ok:
        check_edits(req, settings)
        return
    with pytest.raises(ApiError) as err:
        check_edits(req, settings)
    assert err.value.param == "model" and "cosmos3-tiny" in str(err.value) and "/v1/images/edits" in str(err.value)


def test_the_form_keeps_every_image_part_in_order() -> None:
    form = decode(*_form(("image[]", b"a"), ("prompt", b"p"), ("image[]", b"b"), ("n", b"2")))
    assert form.images == [b"a", b"b"] and form.fields == {"prompt": "p", "n": 2}
    with pytest.raises(ApiError) as err:
        decode(*_form(("file", b"a")))
    assert err.value.param == "file"
