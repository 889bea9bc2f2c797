"""The model a config describes, the way transformers builds and saves it: expected names, shapes and dtypes
(:mod:`.architecture`), the config file found and read (:mod:`.config_file`), and a config's sizes checked against
a checkpoint before a model is built (:mod:`.config_sizes`)."""
