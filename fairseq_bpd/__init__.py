from . import checkpoint_safety, model, criterion, task, superres  # noqa
