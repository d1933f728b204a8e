from . import checkpoint_safety, model, criterion, task  # noqa
