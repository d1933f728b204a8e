"""fairseq's hub interface for blockwise checkpoints: a beam is a request only when given."""
from fairseq.dataclass.configs import GenerationConfig
from fairseq.hub_utils import GeneratorHubInterface

from .errors import BlockwiseRequestError


class BlockwiseHubInterface(GeneratorHubInterface):
    """GeneratorHubInterface whose translate() and generate() take no beam by default.

    fairseq's hub passes beam=5 when none is given, which cannot be told from an
    explicit beam=5, which --blockwise must refuse. Here an omitted beam is greedy
    under --blockwise and fairseq's 5 without it; any beam given is a request.
    """

    def __init__(self, cfg, task, models):
        super().__init__(cfg, task, models)
        # The hub returns one output per input: an input too long for the model stays
        # fairseq's error here, not a skipped line as in fairseq-generate.
        task.skip_invalid_inputs = False

    def default_beam(self):
        return 1 if getattr(self.task.cfg, "blockwise", False) else GenerationConfig.beam

    def translate(self, sentences, beam=None, verbose=False, **kwargs):
        return self.sample(sentences, self.default_beam() if beam is None else beam, verbose, **kwargs)

    def generate(self, tokenized_sentences, beam=None, *args, **kwargs):
        beam = self.default_beam() if beam is None else beam
        # fairseq sets every keyword on the generation options, which the task never
        # reads: blockwise_tree=8 here would decode the chain without a word.
        task_options = [k for k in kwargs if hasattr(self.task.cfg, k) and not hasattr(self.cfg.generation, k)]
        if task_options:
            name = task_options[0]
            raise BlockwiseRequestError(f"{name} is a task option, fixed when the model is loaded: give it to "
                                        f"from_pretrained(..., {name}=...), not to translate() or generate()")
        return super().generate(tokenized_sentences, beam, *args, **kwargs)
