"""The ``edgetrain`` commands, registered explicitly: name -> (module, command object).

A command's module is imported when the command runs or its help is shown, so one command's
dependencies (the in-situ extra's OpenCV) never slow or break another.
"""

from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "memory": ("edgetrain.cli.memory", "memory"),
    "plan": ("edgetrain.cli.plan", "plan_command"),
    "train": ("edgetrain.cli.train", "train_command"),
    "figure1": ("edgetrain.cli.figure", "figure1"),
    "revolve": ("edgetrain.cli.revolve", "revolve_command"),
    "demo": ("edgetrain.cli.demo", "demo"),
    "tiles": ("edgetrain.cli.tiles", "tiles"),
    "models": ("edgetrain.cli.models", "models_command"),
    "insitu": ("edgetrain.cli.insitu", "insitu"),
    "poet": ("edgetrain.cli.poet", "poet_command"),
    "poet-figure": ("edgetrain.cli.poet", "poet_figure"),
}

# A command whose module needs an optional extra: the extra and the packages it brings.
EXTRAS: dict[str, tuple[str, frozenset[str]]] = {
    "insitu": ("insitu", frozenset({"cv2", "PIL", "psutil", "motpy", "filterpy"})),
}

# Flags renamed for one name per concept (--memory: the device's memory; --device: the hardware
# the plan is for). The old names still work for one release, with a note on stderr.
RENAMED_FLAGS: dict[tuple[str, str], str] = {
    ("memory", "--device-memory"): "--memory",
    ("poet", "--ram"): "--memory",
    ("tiles", "--profile"): "--device",
}
