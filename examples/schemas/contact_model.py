"""The contact schema as a pydantic model:

    formwork extract --schema examples/schemas/contact_model.py:Contact examples/docs/contacts
"""
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Contact(BaseModel):
    """A person to get back to."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=60)
    email: str = Field(max_length=80)
    phone: str = Field(max_length=24)
    company: str = Field(max_length=60)
    role: str = Field(max_length=40)
    preferred_channel: Literal["email", "phone", "none"]
