"""A chat template that writes image parts itself: the model's template is the authority for where an image's
tokens go (issue 55). Found by one probe at launch (:meth:`ImageParts.probed`); used by :mod:`pipeline._render`."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class ImageParts:
    """A chat template that writes image parts itself (``{"type": "image"}`` content parts, as a vision model's own
    template does). Each image a message holds (its ``placeholder`` text, where the record had it) is handed to the
    template as an image part, and the text the template writes for it (``written``, found by the probe; it holds
    the processor's image ``token`` once) is then what the processor makes of it: the token itself, or (InternVL,
    whose processor adds them) the token between the family's start and end tokens (``wrapped``)."""

    placeholder: str
    written: str
    token: str
    wrapped: str

    PROBE = [{"role": "user", "content": [{"type": "text", "text": "zq7a"}, {"type": "image"},
                                          {"type": "text", "text": "zq7b"}]}]
    """The probe conversation: an image part between two marked text parts."""
    PLAIN = [{"role": "user", "content": [{"type": "text", "text": "zq7a"}, {"type": "text", "text": "zq7b"}]}]
    """The same without its image part."""

    @classmethod
    def probed(cls, rendered: str, plain: str, spec: Any) -> Optional["ImageParts"]:
        """From the template's renderings of :data:`PROBE` and :data:`PLAIN`: the parts rule when the image part
        adds the processor's image token once (wherever the template puts it: between the texts, or first as
        LLaVA's template puts images), or None (it drops image parts, or renders the list as text)."""
        token = spec.image_token
        if ("zq7a" not in plain or "'type'" in rendered or
                rendered.count(token) != plain.count(token) + 1):
            return None
        a, b = rendered.find("zq7a"), rendered.find("zq7b")
        written = rendered[a + 4:b] if 0 <= a < b and token in rendered[a:b] else token
        from packers import VisionFamily

        wrapped = spec.placeholder if spec.family is VisionFamily.INTERNVL else token  # InternVLProcessor: <img>..</img>
        return cls(spec.placeholder, written, token, wrapped)

    def parts(self, content: str) -> list[dict]:
        """``content`` as content parts: its text between images, and an image part for each placeholder.

        >>> ImageParts("<P>", "<T>\\n", "<T>", "<T>").parts("a<P>b<P>")
        [{'type': 'text', 'text': 'a'}, {'type': 'image'}, {'type': 'text', 'text': 'b'}, {'type': 'image'}]
        """
        out: list[dict] = []
        for k, text in enumerate(content.split(self.placeholder)):
            if k:
                out.append({"type": "image"})
            if text:
                out.append({"type": "text", "text": text})
        return out

    def processed(self, rendered: str) -> str:
        """The template's rendering as the processor rewrites it before expanding each image token."""
        return rendered if self.wrapped == self.token else rendered.replace(self.token, self.wrapped)


def content_text(content: Any) -> str:
    """A message's text: its content, or the text of its content parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content
