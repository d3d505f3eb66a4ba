"""Shared test inputs: small data files of rows, as the loaders read them."""
import json

import pyarrow as pa
import pyarrow.parquet as pq


def write_rows(tmp_path, name: str, rows: list) -> str:
  """Writes `rows` (dicts) to tmp_path/name: parquet for a .parquet name, else JSON lines;
  returns the path."""
  path = tmp_path / name
  if name.endswith(".parquet"):
    pq.write_table(pa.Table.from_pylist(rows), path)
  else:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)
