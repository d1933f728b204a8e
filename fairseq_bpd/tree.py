"""The candidate tree of --blockwise-tree: which (head, rank) paths one block verifies.

Medusa (Cai et al., 2024, section 2.1.2) verifies a static tree of candidates built
from the heads' top choices in one decoder pass. A node is a path of choices: the
rank-r_1 token of head 2, then the rank-r_2 token of head 3 after it, and so on; it
is accepted when its whole path is what greedy decoding picks. If head h+1's rank-r
token is right with probability p[h][r] (measured on held-out data, scripts/tree_rates.py),
and heads are taken as independent, a node's chance of acceptance is the product of
its choices' rates, each accepted node adds one token, and the expected tokens of a
block are 1 + the sum over its nodes. The tree of N nodes with the highest sum is
built greedily: since a path's product never exceeds its prefix's, taking the best
node whose parent is in the tree, N times, gives the N best paths.
"""
import heapq
import json
import logging
import math

import torch

logger = logging.getLogger(__name__)

# Ranks per head a tree may use: beyond ten, rates are too small to be worth a node.
MAX_RANK = 10
# Nodes per tree: the block's n x n mask and n x V log-probs grow with it.
MAX_TREE = 1024


def default_rates(heads, ranks=MAX_RANK):
    """Rates when none were measured: heads x ranks.

    Fitted to the fixture k=8 model's rates on held-out Bible data (scripts/tree_rates.py;
    docs/tree.md): head h's top token is right with probability 0.6 * 0.78^(h-2), its
    rank-r token (r >= 1) with 0.13 * 0.65^(r-1), at most the top token's. Only the
    tree's shape depends on them, never its output.
    """
    rates = []
    for h in range(heads):
        top = 0.6 * 0.78 ** h
        rates.append([top] + [min(top, 0.13 * 0.65 ** (r - 1)) for r in range(1, ranks)])
    return rates


def load_rates(path):
    """The rates a scripts/tree_rates.py run wrote: heads x ranks, from a JSON file."""
    return load_rates_file(path)[0]


def load_rates_file(path):
    """(rates, over) of a scripts/tree_rates.py file, read once (it may be a pipe): the heads x
    ranks table and what the rates were measured over, (proposal_vocab, whether a proposal
    lexicon widened it), None where the file does not say. A tree shaped by rates of other
    proposals is still exact, only shaped for heads that rank differently: the generator
    warns (warn_if_measured_otherwise)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as error:
        raise ValueError(f"--blockwise-tree-rates: cannot read {path} ({error.strerror or error})") from None
    except ValueError as error:  # json's own message says where: "Expecting value: line 1 column 1 (char 0)"
        raise ValueError(f"--blockwise-tree-rates: {path} is not JSON ({error})") from None
    if not isinstance(data, dict) or "rates" not in data:
        raise ValueError(f"--blockwise-tree-rates: {path} is no scripts/tree_rates.py file: it has no \"rates\" entry")
    rates = data["rates"]
    if not is_rate_table(rates):
        raise ValueError(f"--blockwise-tree-rates: {path} holds no heads x ranks table of rates in [0, 1]")
    vocab = data.get("proposal_vocab")
    known = type(vocab) is int and vocab >= 0 and "proposal_lexicon" in data
    return rates, (vocab, bool(data["proposal_lexicon"])) if known else None


# The mismatches already warned of: a hub or a benchmark builds a generator per call.
WARNED = set()


def warn_if_measured_otherwise(over, proposal_vocab, lexicon, vocab_size):
    """Warn, once, where rates measured over `over` ((proposal_vocab, lexicon), or None:
    unknown) shape a tree for proposals over (proposal_vocab, lexicon): a lexicon or a wider
    shortlist raises every head's rates, so a tree shaped by the other rates is exact but not
    the best one for these proposals. A proposal_vocab of 0 or of the whole dictionary
    (`vocab_size` entries) is the same thing."""
    if over is None:
        return
    measured, decoding = (whole(over[0], vocab_size), over[1]), (whole(proposal_vocab, vocab_size), lexicon)
    if measured != decoding and measured + decoding not in WARNED:
        WARNED.add(measured + decoding)
        logger.warning(
            f"--blockwise-tree-rates were measured over {proposals(*measured)}; this decoding proposes over "
            f"{proposals(*decoding)}: the tree stays exact, but its shape may not be the fastest "
            f"(scripts/tree_rates.py measures the rates for it with the same --proposal-vocab and "
            f"--proposal-lexicon as --blockwise-proposal-vocab and --blockwise-proposal-lexicon)")


def whole(proposal_vocab, vocab_size):
    """0 for the whole dictionary, however it was written."""
    return 0 if proposal_vocab >= vocab_size else proposal_vocab


def proposals(vocab, lexicon):
    """What proposals range over, in words."""
    where = f"the dictionary's first {vocab} entries" if vocab else "the whole dictionary"
    return where + (" and a proposal lexicon" if lexicon else "")


def is_rate_table(rates):
    """Whether `rates` is a non-empty heads x ranks table (lists or tuples) of rates in [0, 1]."""
    rows = (list, tuple)
    return (isinstance(rates, rows) and bool(rates)
            and all(isinstance(row, rows) and row and all(map(is_rate, row)) for row in rates))


def is_rate(value):
    """A JSON number in [0, 1] (strings, nulls, lists and booleans are none)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def best_paths(rates, size):
    """The `size` (head, rank) paths of highest expected acceptance, parents first.

    rates: heads x ranks (heads 2, 3, ...). Returns a list of paths, each a tuple of
    ranks (its length is its depth), ordered by depth and, within a depth, by
    expected acceptance.
    """
    if not rates or size < 1:
        return []
    frontier = [(-rates[0][r], (r,)) for r in range(len(rates[0]))]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < size:
        negative, path = heapq.heappop(frontier)
        chosen.append((len(path), negative, path))
        if len(path) < len(rates):
            for r, p in enumerate(rates[len(path)]):
                heapq.heappush(frontier, (negative * p, path + (r,)))
    return [path for _, _, path in sorted(chosen)]


class Tree:
    """A block's layout: node 0 is the last committed token, nodes 1..N the candidates.

    depth, rank: n (the root: 0 and 0); parents: n (the root: 0); paths: n x D+1,
    each node's ancestors by depth, itself at its depth (padding repeats it); mask:
    n x n, 0 where a node may attend (its ancestors and itself) and -inf elsewhere;
    chain: n, whether every choice on the path is a top choice (the chain's nodes);
    hydra: per depth, what chained heads need to propose it after each parent (hydra_plan).
    """

    def __init__(self, paths):
        index = {(): 0}
        for path in paths:
            index[path] = len(index)
        nodes = [()] + list(paths)
        self.size = len(nodes)
        self.max_depth = max(map(len, nodes))
        self.topn = 1 + max((max(path) for path in paths), default=0)
        self.depth = torch.tensor([len(p) for p in nodes])
        self.rank = torch.tensor([p[-1] if p else 0 for p in nodes])
        self.parents = torch.tensor([index[p[:-1]] if p else 0 for p in nodes])
        self.chain = torch.tensor([not any(p) for p in nodes])
        # Every node the top choice after the one before: the paper's block, whose
        # verification needs no per-level indexing (the generator's fast path).
        self.is_chain = bool(self.chain.all())
        self.paths = torch.tensor([[index[p[: min(d, len(p))]] for d in range(self.max_depth + 1)] for p in nodes])
        ancestors = torch.zeros(self.size, self.size, dtype=torch.bool)
        for i, p in enumerate(nodes):
            ancestors[i, self.paths[i, : len(p) + 1]] = True
        self.ancestors = ancestors  # n x n: j is i or an ancestor of i
        self.mask = torch.zeros(self.size, self.size).masked_fill_(~ancestors, -math.inf)
        # Verification adds running scores depth by depth: (nodes, their parents) per depth.
        self.levels = [
            ((self.depth == d).nonzero()[:, 0], self.parents[self.depth == d]) for d in range(1, self.max_depth + 1)
        ]
        self.hydra = self.hydra_plan()
        self._prefixes = {}

    def hydra_plan(self):
        """Per depth d = 1..D, how chained heads propose the depth-d nodes after their own
        parents (ChainedHeads.nodes): the parents P_d (the depth d-1 nodes with children),
        the row of P_{d-1} each one's token was chosen from, the depth-d nodes, the row of P_d
        of each one's parent, their ranks, and the ranks the depth uses (an int)."""
        plan, rows = [], {0: 0}  # rows: node -> its row among its depth's parents
        for nodes, parents in self.levels:
            unique = sorted(set(parents.tolist()))
            above, rows = rows, {p: r for r, p in enumerate(unique)}
            ranks = self.rank[nodes]
            plan.append((torch.tensor(unique), torch.tensor([above[int(self.parents[p])] for p in unique]),
                         nodes, torch.tensor([rows[p] for p in parents.tolist()]), ranks, 1 + int(ranks.max())))
        return plan

    @classmethod
    def chain_of(cls, proposals):
        """Today's block: `proposals` top choices, each after the one before."""
        return cls([(0,) * d for d in range(1, proposals + 1)])

    @classmethod
    def best(cls, rates, size, max_depth):
        """The `size`-node tree of highest expected acceptance over heads 2..max_depth+1."""
        return cls(best_paths([row[:MAX_RANK] for row in rates[:max_depth]], size))

    def upto(self, max_depth):
        """The sub-tree of nodes no deeper than `max_depth` (a prefix: nodes go by depth)."""
        if max_depth >= self.max_depth:
            return self
        if max_depth not in self._prefixes:
            count = int((self.depth <= max_depth).sum())
            self._prefixes[max_depth] = Tree(self.path_tuples()[1:count]).to(self.depth.device)
        return self._prefixes[max_depth]

    def path_tuples(self):
        """Each node's ranks from the root: n tuples."""
        tuples = [()]
        for i in range(1, self.size):
            tuples.append(tuples[int(self.parents[i])] + (int(self.rank[i]),))
        return tuples

    def to(self, device):
        """Move the tensors (and the cached sub-trees') to `device`; returns self."""
        for name in ("depth", "rank", "parents", "chain", "paths", "ancestors", "mask"):
            setattr(self, name, getattr(self, name).to(device))
        self.levels = [(nodes.to(device), parents.to(device)) for nodes, parents in self.levels]
        self.hydra = [(*(t.to(device) for t in depth[:-1]), depth[-1]) for depth in self.hydra]
        for prefix in self._prefixes.values():
            prefix.to(device)
        return self

    def expected_tokens(self, rates):
        """1 + the sum of the nodes' acceptance products: expected tokens per block."""
        total = 1.0
        for path in self.path_tuples()[1:]:
            total += math.prod(rates[h][r] for h, r in enumerate(path))
        return total
