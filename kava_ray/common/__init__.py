"""Config, errors, files, metrics file, trackers, placement rules, search spaces: the base every layer uses (no Ray)."""
