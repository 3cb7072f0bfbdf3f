"""What every section of the config file's schema shares: strict models (unknown keys are
errors) and the number types the fields use."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, lt=1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=False, frozen=True)
