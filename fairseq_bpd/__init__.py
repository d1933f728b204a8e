from . import patches, model, criterion, task, superres  # noqa
