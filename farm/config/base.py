"""What every section of the configuration shares: its base model (unknown keys are errors), the error
every loader raises, and where relative paths resolve."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

# The defaults ship inside the package (farm/defaults/default.yaml, a link to config/default.yaml in the
# checkout), so an installed farm finds them anywhere. Relative paths (state_dir, profiles) resolve against
# the checkout when running from one, else against the working directory.
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[1] / "defaults" / "default.yaml"
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
PROJECT_ROOT = _PACKAGE_PARENT if (_PACKAGE_PARENT / "config" / "default.yaml").is_file() else Path.cwd()


class ConfigError(RuntimeError):
    """Raised for an invalid or unreadable configuration; the message says what and where."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
