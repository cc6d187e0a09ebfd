"""A speech reference's side of a bench round (bench/speech_families.py): the reference
package serves one request at a time, so its TTFA is a whole call and its cN is N calls
one after the other."""

from __future__ import annotations


class Reference:
    """One request at a time; `many(k)` is k of them ({"wall", "audio_s"[, "text_s"]})."""

    def one(self) -> dict:
        raise NotImplementedError

    def warm(self) -> None:
        self.one()

    def many(self, k: int) -> list[dict]:
        return [self.one() for _ in range(k)]

    def round(self, concurrency: int) -> dict:
        first, *rest = self.many(1 + concurrency)
        out = {"ttfa_s": first["wall"], "rtf_c1": first["wall"] / first["audio_s"],
               "rtf_cN": sum(r["wall"] for r in rest) / sum(r["audio_s"] for r in rest), "audio_s": first["audio_s"]}
        if "text_s" in first:
            out["text_s"] = first["text_s"]
        return out
