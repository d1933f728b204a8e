from . import model, criterion, task  # noqa
