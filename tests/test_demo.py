"""scripts/demo.py, what `make demo` runs: its functions read the module's helpers, not
locals of the same name (a local `run` in main() once made the first call to the module's
run() fail before anything was decoded)."""
import os
import symtable

DEMO = os.path.join(os.path.dirname(__file__), "..", "scripts", "demo.py")


def test_no_function_of_the_demo_assigns_a_name_of_the_module():
    with open(DEMO) as f:
        table = symtable.symtable(f.read(), DEMO, "exec")
    module_names = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    shadowed = {
        (child.get_name(), s.get_name())
        for child in table.get_children() if child.get_type() == "function"
        for s in child.get_symbols() if s.is_local() and s.get_name() in module_names and s.is_assigned()
    }
    assert not shadowed, f"locals shadowing the module's names: {sorted(shadowed)}"
