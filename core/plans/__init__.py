"""The plan: its types (plan.py), its file read back against the schema (plan_file.py, plan_schema.json),
the JSON codec of its dataclasses (dataclass_json.py) and its verification (verify.py).
"""
