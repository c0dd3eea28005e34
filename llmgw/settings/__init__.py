"""One spelling per setting: a settings class per process makes its flags, file, variables and --show-config.

Each long-running command (``llmgw server``, ``gateway``, ``agent``, ``dev``)
has one attrs settings class whose fields are declared with
:func:`setting`: the field's name is the key of its config file and, with
``-`` for ``_``, its flag (``max_attempts``, ``--max-attempts``); the field's
metadata holds its help, environment variable and range. From it:

- :func:`settings_options` makes the click options, ``--config PATH`` and ``--show-config``;
- :func:`load_settings` builds the settings: from the flag, else the
  environment variable, else the config file (TOML; relative paths are the
  file's), else the default; every value checked, an error naming the flag,
  variable, or file and key, and what was expected (:class:`SettingsError`, exit 2);
- :func:`settings_lines` prints them as a config file, each with where it came from.
"""

from llmgw.settings.fields import Setting, setting, settings_fields
from llmgw.settings.load import Loaded, SettingsError, load_settings
from llmgw.settings.logged import LogSettings
from llmgw.settings.options import settings_options
from llmgw.settings.show import settings_lines, toml_value

__all__ = [
    "Loaded",
    "LogSettings",
    "Setting",
    "SettingsError",
    "load_settings",
    "setting",
    "settings_fields",
    "settings_lines",
    "settings_options",
    "toml_value",
]
