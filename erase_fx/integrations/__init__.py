"""Training frameworks around erase_fx's whole-step capture (`erase_fx.compile_step`).

Each module imports its framework only when used: ``import erase_fx`` never
imports one. `erase_fx.integrations.lightning`: Lightning's ``Trainer`` with
manual optimization.
"""
