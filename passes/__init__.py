"""Standalone torch.fx passes, each usable on its own on any GraphModule.

trace -> functionalize -> annotate_costs -> partition -> codegen; see DESIGN.md.
"""
