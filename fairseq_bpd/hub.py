"""fairseq's hub interface for blockwise checkpoints: a beam is a request only when given."""
from fairseq.dataclass.configs import GenerationConfig
from fairseq.hub_utils import GeneratorHubInterface



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
        # A task option among kwargs (blockwise_tree=8) is refused when the task builds the
        # generator (refusals.refuse_task_options_in_generation): fairseq would set it on the
        # generation options and forget it.
        beam = self.default_beam() if beam is None else beam
        return super().generate(tokenized_sentences, beam, *args, **kwargs)
