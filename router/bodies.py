"""The base of every request body the router reads (OpenAI's, the admin API's)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictBody(BaseModel):
    """A request body. Unknown fields are ignored, as OpenAI-compatible servers do; known ones
    are type-checked strictly."""

    model_config = ConfigDict(strict=True, extra="ignore")
