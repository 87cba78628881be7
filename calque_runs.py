"""Runs: read items, stage and send claims, wait on summaries, cancel, redrive, report.
Stands on calque_core; calque.py's submit and runs verbs, the fleets and the dashboard call it."""
import collections, contextlib, datetime, glob, io, itertools, json, math, os, re, shutil, signal
import stat, time, zipfile, zlib, sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from calque_core import (BYTES, CLAIM_BYTES, CLAIM_LOOKAHEAD_MAX, CLAIM_SIZE_MAX, Changed,
                         DLQ_SCAN_WAIT, ERRORS_KEPT, ERROR_GROUPS_SHOWN, EXIT_FAILED, EXIT_OK,
                         FIRST_ITEMS_SHOWN, ITEM_BYTES_MAX, ITEM_DEPTH_MAX, LOCAL_SUMMARY_WAIT,
                         LOCAL_WRITERS, LeaseLost, LocalStore, NUMERIC_KINDS, NotFound, Part,
                         READ_BLOCK, READ_FIRST, RUN_RECHECK, RUN_RECHECK_MAX, Requests,
                         ResultsIncomplete, S3Store, SEND_BATCH, STAGE_AHEAD, STAGE_BYTES,
                         STORE_WRITERS, SUMMARY_BATCH, SUMMARY_POLL_FLOOR, SUMMARY_POLL_MIN,
                         SUMMARY_WAIT_MAX, StoreFault, Unavailable, UserError, _aws_error_info,
                         _parse_time, _run_defaults, array_items, aws_error_line, bytes_text,
                         checked_json, claim_id, claim_items, claim_sizes, claim_summary,
                         claims_progress, command, did_you_mean, dlq_name, dumps, format_sizes,
                         list_runs, list_summaries, make_message, manifest_key, merge_fields,
                         new_run_id, note_queue_deleted, now_iso, orjson, parse_message,
                         read_claim_parts, read_json, read_summaries, result_lines, results_key,
                         results_prefix, run_key, run_queue_names, size_text, summary_claims,
                         summary_key, text_lines, to_jsonable, unchanged, update_run, write_json)


# ------------------------------------------------------------------------------------------------
# 5. submit and runs: read items, stage and send claims, wait on summaries, cancel, redrive, report
def read_items(path, columns=None):
    """Items from a JSONL file ('-': stdin), each a JsonText, read as staged but its first block at
    once (a bad line there is refused first). A .npy or .npz file is numeric (ArrayItems); a Parquet
    or Arrow file, folder or glob is a table (TableItems) of which `columns` are read; a folder or
    glob of other files, or an s3:// prefix or glob, is one item a file (FileItems)."""
    if path.endswith((".npy", ".npz")):
        return ArrayItems.load(path)
    folder = glob.has_magic(path) or os.path.isdir(path)
    if not path.startswith("s3://") and (path.endswith(TABLE_SUFFIXES) or folder and _holds_tables(path)):
        return TableItems.open(path, columns)
    if folder or path.startswith("s3://"):
        return FileItems.open(path, columns)
    if columns:
        raise UserError(f"--columns applies to Parquet or Arrow input, not {path}")
    try:
        stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise unreadable_items(path, e) from None
    blocks = jsonl_blocks(stream, path)
    return itertools.chain(next(blocks), itertools.chain.from_iterable(blocks))


def unreadable_items(path, error):
    """The UserError for an items file that cannot be opened (missing, a folder, no permission)."""
    where = "" if os.path.isabs(path) else f", relative to {os.getcwd()}"
    return UserError(f"cannot read items file {path}: {error.strerror or error} ---> HINT: give "
                     f"the path of a JSONL, .npy or .npz file, of a Parquet or Arrow file or "
                     f"folder, of a folder of files or a quoted glob (or - for stdin){where}")


def jsonl_blocks(stream, path):
    """The items of a JSONL stream, a list per block (READ_FIRST bytes, doubling to READ_BLOCK). A
    bad line is a UserError naming path:line; so is a stream without items."""
    lineno, rest, count, size = 1, b"", 0, READ_FIRST
    with stream:
        while True:
            try:
                block = stream.read1(size)   # what is there, up to a block: a pipe's lines
                size = min(2 * size, READ_BLOCK)
            except OSError as e:
                raise UserError(f"cannot read items file {path}: {e.strerror}") from None
            data = rest + block
            if block:
                cut = data.rfind(b"\n") + 1
                data, rest = data[:cut], data[cut:]
            items = [checked_line(line, path, n) for n, line in text_lines(data, path, lineno) if line.strip()]
            lineno += data.count(b"\n")
            if items:
                count += len(items)
                yield items
            if not block:
                break
    if not count:
        raise UserError(f"{path} holds no items: give one JSON item per line")


class JsonText(str):
    """An item as its JSONL line, checked and trimmed: its manifest takes the text as it is."""
    __slots__ = ()


def checked_line(line, path, lineno):
    """The JsonText of one JSONL line, or a UserError naming path:lineno (submit refuses a bad line,
    no worker dead-letters it). An item nested deeper than ITEM_DEPTH_MAX is refused too: its
    manifest nests it deeper, and json.loads stops near 1000 levels."""
    try:
        item = checked_json(line)
        deep = (len(line) > ITEM_DEPTH_MAX and line.count("[") + line.count("{") > ITEM_DEPTH_MAX
                and json_depth(item) > ITEM_DEPTH_MAX)
    except RecursionError:
        deep = True
    except ValueError as e:   # a JSONDecodeError, or an integer over Python's 4300 digits
        raise UserError(f"{path}:{lineno}: not valid JSON ({getattr(e, 'msg', e)}): "
                        f"one JSON item per line") from None
    if deep:
        raise UserError(f"{path}:{lineno}: nested deeper than {ITEM_DEPTH_MAX} levels ---> HINT: "
                        f"flatten the item (calque nests it inside a manifest)")
    return JsonText(line.strip(" \t\r"))   # JSON's whitespace (a valid line has no other)


def json_depth(value):
    """Levels of nested arrays and objects in a parsed JSON value, walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            todo += [(c, depth + 1) for c in (node.values() if isinstance(node, dict) else node)]
    return deepest


class ArrayItems:
    """Numeric items from a .npy file (item i = {"input": a[i]}) or a .npz file, array `k` [N, ...]
    the field k of every item; `k_offsets` (N+1 indices) makes `k` ragged. Staged as .npy objects
    per claim and field, which the worker maps as views: no per-item parsing, no pickle."""

    def __init__(self, fields, count, source):
        self.fields, self.count, self.source = fields, count, source   # name -> (values, offsets)

    def __len__(self):
        return self.count

    @classmethod
    def load(cls, path):
        return cls.from_arrays(read_arrays(path), path)

    def chunks(self, sizes):
        """(start, stop, None, 0) of each claim (sizes: ClaimSizes): the arrays are sliced when staged."""
        start = 0
        while start < self.count:
            stop = min(start + sizes.next(self.count - start), self.count)
            yield start, stop, None, 0
            start = stop

    @classmethod
    def from_arrays(cls, arrays, path):
        """From {name: array}; `path` names them in errors."""
        import numpy as np
        arrays = {name: np.asarray(values) for name, values in arrays.items()}
        fields, counts = {}, {}
        for name, values in arrays.items():
            if name.endswith("_offsets") and name[:-len("_offsets")] in arrays:
                continue
            if values.dtype.hasobject or values.dtype.kind not in "biuf":
                raise UserError(f"{path}: array {name!r} has dtype {values.dtype}: only numeric arrays are items")
            offsets = arrays.get(name + "_offsets")
            if offsets is not None:
                if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 1 or offsets[0] != 0 \
                        or offsets[-1] != len(values) or (np.diff(offsets) < 0).any() or values.ndim != 1:
                    raise UserError(f"{path}: {name}_offsets must be N+1 increasing ints from 0 to "
                                    f"len({name}) over a 1-D {name}")
                counts[name] = len(offsets) - 1
            else:
                if values.ndim == 0:
                    raise UserError(f"{path}: array {name!r} is a scalar: its first axis must index the items")
                counts[name] = values.shape[0]
            fields[name] = (np.ascontiguousarray(values), offsets)
        if len(set(counts.values())) > 1:
            raise UserError(f"{path}: fields disagree on the item count: {counts}")
        count = next(iter(counts.values()), 0)
        if count == 0:
            raise UserError(f"{path} holds no items")
        return cls(fields, count, path)

    def stage(self, backend, run_id, claim, start, stop):
        """Write this claim's slice of every field as .npy; the manifest's `arrays`."""
        fields = {}
        for name, (values, offsets) in self.fields.items():
            if offsets is None:
                fields[name] = {"values": values[start:stop]}
            else:
                fields[name] = {"values": values[offsets[start]:offsets[stop]],
                                "offsets": offsets[start:stop + 1] - offsets[start]}
        return stage_arrays(backend, run_id, claim, fields)


def stage_arrays(backend, run_id, claim, fields):
    """Write each field's {role: array} (values, offsets, valid) as .npy objects; returns the
    manifest's `arrays` ({field: {role: key}}), keys numbered (a column name need not be safe)."""
    import numpy as np
    entry = {}
    for number, (name, roles) in enumerate(fields.items()):
        entry[name] = {}
        for role, array in roles.items():
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
            key = f"runs/{run_id}/inputs/{claim}/{number}.{role}.npy"
            backend.store.put(key, buf.getvalue())
            entry[name][role] = key
    return entry


def read_arrays(path):
    """{name: array} of a .npy ({"input": a}) or .npz file; any fault is a UserError naming it."""
    import numpy as np
    try:
        # a .npy is mapped: each claim's slice is paged in as it is staged (an .npz member is read)
        loaded = np.load(path, mmap_mode="r", allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return {"input": loaded}
        with loaded:   # an NpzFile reads each member on access: read them all inside this try
            return {k: loaded[k] for k in loaded.files}
    except OSError as e:
        raise unreadable_items(path, e) from None
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        reason = str(e).split(". ")[0].rstrip(".") or type(e).__name__
        raise UserError(f"{path}: not a numeric .npy or .npz file ({reason}) ---> HINT: save plain numeric arrays "
                        f"with numpy.save or numpy.savez (object arrays would need pickle)") from None


TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")   # tables (as a folder or glob of .parquet)


class TableItems:
    """Items from Arrow tables, one a row ({column: value}): Parquet (a file, folder or glob), Arrow
    IPC, or a pyarrow.Table, pandas DataFrame or datasets.Dataset, streamed a claim at a time.
    Numeric columns (and lists of numbers) are staged as .npy (a null: None); others go as JSON in
    the manifest, dates and times as ISO text, binary values (an HF Image's struct<bytes, path>)
    as bytes (stage_bytes); a type JSON cannot hold is refused up front. A Parquet path with binary
    columns is staged by reference (row ranges) where media_form says the workers can read it."""

    def __init__(self, schema, count, batches, source, files=None):
        import pyarrow as pa
        self.count, self.batches, self.source, self.files = count, batches, source, files
        self.numeric, self.json, self.binary = [], [], []
        for field in schema:
            kind = _column_kind(pa, field.type)
            if kind is None:
                raise UserError(f"{source}: column {field.name!r} is {field.type}, which has no JSON "
                                f"form ---> HINT: leave it out with --columns, or cast it (to "
                                f"string) before submitting")
            (self.numeric if kind == "numeric" else self.json).append(field.name)
            if _holds_binary(pa, field.type):
                self.binary.append(field.name)
        self.columns, self.media, self.by_reference = schema.names, bool(self.binary), False
        if not count:
            raise UserError(f"{source} holds no items")

    def __len__(self):
        return self.count

    @classmethod
    def open(cls, source, columns=None, where=None):
        """From a path (TABLE_SUFFIXES, folder, glob) or a table-like object; only `columns`."""
        import pyarrow as pa
        where = where or (source if isinstance(source, str) else type(source).__name__)
        if isinstance(source, str):
            return cls._open_path(source, columns, where)
        module = type(source).__module__.split(".")[0]
        if module == "pandas":
            source = pa.Table.from_pandas(source, preserve_index=False)
        elif module == "datasets":   # a Hugging Face Dataset: its Arrow rows, its own iterator
            schema = _select(source.features.arrow_schema, columns, where)
            arrow = source.with_format("arrow")
            return cls(schema, len(source), lambda rows: itertools.chain.from_iterable(
                t.select(schema.names).to_batches() for t in arrow.iter(batch_size=rows)), where)
        table = pa.table(source)   # a Table as it is; a RecordBatch
        schema = _select(table.schema, columns, where)
        table = table.select(schema.names)
        return cls(schema, table.num_rows, lambda rows: iter(table.to_batches(rows)), where)

    @classmethod
    def _open_path(cls, path, columns, where):
        import pyarrow as pa
        import pyarrow.parquet as pq
        if path.endswith((".arrow", ".feather")):
            try:
                reader = pa.ipc.open_file(pa.memory_map(path))   # batches paged in as staged
            except (OSError, pa.ArrowInvalid) as e:
                raise UserError(f"{path}: not an Arrow IPC file ({e}) ---> HINT: write it with "
                                f"pyarrow.feather.write_feather or pyarrow.ipc.new_file") from None
            schema = _select(reader.schema, columns, where)
            count = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            return cls(schema, count, lambda rows: (reader.get_batch(i).select(schema.names)
                                                    for i in range(reader.num_record_batches)), where)
        files = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True) if os.path.isdir(path)
                       else glob.glob(path, recursive=True) if glob.has_magic(path) else [path])
        if not files:
            raise UserError(f"{path}: no .parquet file there ---> HINT: give a Parquet file, a "
                            f"folder of them or a quoted glob such as 'data/*.parquet'")
        # malloc gives back what the readers free (mimalloc kept ~20 MiB more); read page by
        # page through a 1 MiB buffer, not a row group at once
        opened, pool = [], pa.default_memory_pool()
        pa.set_memory_pool(pa.system_memory_pool())
        try:
            for file in files:
                try:   # stat first: a by-reference claim names the file as it was before it was read
                    seen = os.stat(file)
                    opened.append((file, pq.ParquetFile(file, pre_buffer=False, buffer_size=1 << 20), seen))
                except FileNotFoundError as e:
                    raise unreadable_items(file, e) from None
                except (OSError, pa.ArrowInvalid) as e:
                    raise UserError(f"{file}: not a Parquet file ({e})") from None
        finally:
            pa.set_memory_pool(pool)
        schema = _select(opened[0][1].schema_arrow, columns, where)
        for file, f, _ in opened:
            theirs = f.schema_arrow
            if any(name not in theirs.names or theirs.field(name).type != schema.field(name).type
                   for name in schema.names):
                raise UserError(f"{file}: its columns differ from {files[0]}'s ---> HINT: give "
                                f"files of one schema, or pick shared columns with --columns")
        return cls(schema, sum(f.metadata.num_rows for _, f, _ in opened), lambda rows: (
            b for _, f, _ in opened for b in f.iter_batches(rows, columns=schema.names, use_threads=False)),
            where, opened)

    def chunks(self, claim_sizes):
        """(start, stop, table, media bytes) of each claim (claim_sizes: ClaimSizes), fewer rows where
        their media bytes pass CLAIM_BYTES, cut as the batches are read (by reference: _ranges)."""
        import pyarrow as pa
        if self.by_reference:
            yield from self._ranges(claim_sizes)
            return
        size = claim_sizes.next(self.count)
        held, rows, start, sizes = [], 0, 0, []   # sizes: the held rows' media bytes (media only)
        for batch in itertools.chain(self.batches(self._read_rows(claim_sizes.fixed or claim_sizes.hi)), [None]):
            if batch is not None:
                held.append(batch)
                rows += batch.num_rows
                if self.media:
                    sizes += self._row_bytes(batch, start + len(sizes))
            while rows >= size or (batch is None and rows) or (self.media and sum(sizes) >= CLAIM_BYTES):
                table = pa.Table.from_batches(held)
                take = _fitting(sizes[:size]) if self.media else min(size, rows)
                yield start, start + take, table.slice(0, take), sum(sizes[:take])
                held, rows, start, sizes = table.slice(take).to_batches(), rows - take, start + take, sizes[take:]
                size = claim_sizes.next(self.count - start)

    def _read_rows(self, size):
        """Rows a read takes: a claim's, fewer for a Parquet file of media, so that one read holds
        about a quarter of CLAIM_BYTES by its row groups' sizes."""
        if not (self.media and self.files):
            return size
        total = sum(f.metadata.row_group(g).total_byte_size for _, f, _ in self.files
                    for g in range(f.metadata.num_row_groups))
        return max(1, min(size, CLAIM_BYTES // 4 * self.count // max(total, 1)))

    def _row_bytes(self, batch, first):
        """Each row's media bytes (its binary values'); a row over ITEM_BYTES_MAX is refused."""
        import numpy as np
        sizes = sum((_binary_sizes(batch.column(name)) for name in self.binary), np.zeros(batch.num_rows, np.int64))
        over = np.flatnonzero(sizes > ITEM_BYTES_MAX)
        if len(over):
            raise _too_large(f"{self.source}: row {first + int(over[0])}", int(sizes[over[0]]))
        return sizes.tolist()

    def _ranges(self, claim_sizes):
        """(start, stop, [[file URI, size, mtime ns, first row, stop row], ...], 0) of each claim
        (claim_sizes), fewer rows where its row groups' bytes pass CLAIM_BYTES: metadata only."""
        segments, rows, held, start = [], 0, 0.0, 0
        size = claim_sizes.next(self.count)
        for path, f, seen in self.files:
            uri, at = "file://" + os.path.abspath(path), 0
            for g in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(g).num_rows
                per_row = f.metadata.row_group(g).total_byte_size / max(n, 1)
                if per_row > ITEM_BYTES_MAX:
                    raise _too_large(f"{path}: the rows of row group {g}", int(per_row))
                while n:
                    take = min(size - rows, n, int((CLAIM_BYTES - held) // per_row) if per_row else n)
                    take = max(take, 0 if rows else 1)
                    if take and segments and segments[-1][0] == uri and segments[-1][4] == at:
                        segments[-1][4] += take
                    elif take:
                        segments.append([uri, seen.st_size, seen.st_mtime_ns, at, at + take])
                    rows, held, at, n = rows + take, held + take * per_row, at + take, n - take
                    if n or rows == size:   # full: the next rows go in the next claim
                        yield start, start + rows, segments, 0
                        segments, rows, held, start = [], 0, 0.0, start + rows
                        size = claim_sizes.next(self.count - start)
        if rows:
            yield start, start + rows, segments, 0

    def stage(self, backend, run_id, claim, start, table):
        """A claim's manifest fields: JSON columns as `items` (their bytes beside: `bytes`), numeric
        ones as `arrays`; by reference, its row ranges (`rows`)."""
        import pyarrow as pa
        if self.by_reference:
            return {"rows": {"columns": self.columns, "files": table}}
        fields = {name: _numeric_column(table.column(name).combine_chunks(), name, start, self.source)
                  for name in self.numeric}
        staged = {"arrays": stage_arrays(backend, run_id, claim, fields)} if fields else {}
        if self.json:
            blob, columns = Blob(), []
            for name in self.json:   # binary values straight from Arrow's buffers, where they can be
                column = table.column(name)
                if name in self.binary:
                    firsts = itertools.accumulate((len(c) for c in column.chunks), initial=0)
                    bare = [_without_binary(c, [name], blob, k) for c, k in zip(column.chunks, firsts)]
                    column = column if None in bare else pa.chunked_array(bare, pa.null() if not bare else None)
                columns.append(_json_column(column))
            items = [dict(zip(self.json, row)) for row in zip(*columns)]
            staged.update(stage_bytes(backend, run_id, claim, items, blob) if self.media else {"items": items})
        return staged


def _select(schema, columns, where):
    """The schema of the `columns` asked for (all when None); an unknown one is a UserError."""
    if not columns:
        return schema
    for name in columns:
        if name not in schema.names:
            raise UserError(f"{where}: no column {name!r}{did_you_mean(name, schema.names)} ---> "
                            f"HINT: its columns: {', '.join(schema.names)}")
    import pyarrow as pa
    return pa.schema([schema.field(name) for name in columns])


def _is_number(pa, t):
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_list(pa, t):
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _column_kind(pa, t):
    """"numeric" (.npy), "json" (in the manifest) or None (no JSON form) for an Arrow type."""
    if _is_number(pa, t) or (_is_list(pa, t) and _is_number(pa, t.value_type)):
        return "numeric"
    return "json" if pa.types.is_temporal(t) or _json_type(pa, t) else None


def _json_type(pa, t):
    """True for a type whose to_pylist values are JSON or bytes (or lists, structs, dicts of them)."""
    if _is_number(pa, t) or pa.types.is_null(t) or pa.types.is_string(t) or pa.types.is_large_string(t) \
            or _is_binary(pa, t):
        return True
    if pa.types.is_dictionary(t) or _is_list(pa, t):
        return _json_type(pa, t.value_type)
    return pa.types.is_struct(t) and all(_json_type(pa, t.field(i).type) for i in range(t.num_fields))


def _is_binary(pa, t):
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) \
        or pa.types.is_binary_view(t)


def _holds_binary(pa, t):
    """Whether an Arrow type is binary or holds binary (a struct's field, a list's values)."""
    if _is_binary(pa, t):
        return True
    if pa.types.is_struct(t):
        return any(_holds_binary(pa, t.field(i).type) for i in range(t.num_fields))
    return (_is_list(pa, t) or pa.types.is_dictionary(t)) and _holds_binary(pa, t.value_type)


def _binary_sizes(array):
    """The bytes of the binary values in each row of an Arrow array (in structs and lists too), as
    a numpy int64 array: what a row of media weighs."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    t, rows = array.type, len(array)
    if _is_binary(pa, t):
        return np.asarray(pc.binary_length(array).fill_null(0), np.int64)
    if pa.types.is_struct(t):
        return sum((_binary_sizes(child) for child in array.flatten()), np.zeros(rows, np.int64))
    if _is_list(pa, t) and _holds_binary(pa, t.value_type):
        parents = np.asarray(pc.list_parent_indices(array), np.int64)
        return np.bincount(parents, _binary_sizes(array.flatten()), rows).astype(np.int64)
    return np.zeros(rows, np.int64)


def _json_column(column):
    """A column's values as Python values for JSON (dates and times as ISO text)."""
    import pyarrow as pa
    if pa.types.is_temporal(column.type):
        return [None if v is None else v.isoformat() for v in column.to_pylist()]
    return column.to_pylist()


def _numeric_column(array, name, start, source):
    """A claim's numeric column as {role: numpy array}: values, offsets (lists), valid (nulls); a
    null inside a list is a UserError."""
    import numpy as np
    import pyarrow as pa
    roles = {}
    if array.null_count:
        roles["valid"] = _to_numpy(array.is_valid())
    if _is_list(pa, array.type):
        if array.null_count:
            array = array.fill_null(pa.scalar([0] * array.type.list_size if pa.types.is_fixed_size_list(array.type)
                                              else [], array.type))
        values = array.flatten()
        if values.null_count:
            lengths = np.cumsum(array.value_lengths().to_numpy())
            row = int(np.searchsorted(lengths, np.flatnonzero(_to_numpy(values.is_null()))[0], side="right"))
            raise UserError(f"{source}: row {start + row}, column {name!r}: a null inside a list of numbers ---> "
                            f"HINT: fill it (pyarrow.compute.fill_null) or leave the column out with --columns")
        values = _to_numpy(values)
        if pa.types.is_fixed_size_list(array.type):
            roles["values"] = values.reshape(len(array), array.type.list_size)
        else:
            offsets = array.offsets.to_numpy()
            roles["values"], roles["offsets"] = values, (offsets - offsets[0]).astype(np.int64)
    else:
        roles["values"] = _to_numpy(array.fill_null(False if pa.types.is_boolean(array.type) else 0)
                                    if array.null_count else array)
    return roles


def _to_numpy(array):
    """A numeric Arrow array without nulls as a numpy view (bools through uint8); no pandas."""
    import numpy as np
    import pyarrow as pa
    if pa.types.is_boolean(array.type):
        return _to_numpy(array.cast(pa.uint8())).view(bool)
    dtype = np.dtype({"halffloat": "float16", "float": "float32", "double": "float64"}.get(str(array.type),
                                                                                          str(array.type)))
    return np.frombuffer(array.buffers()[1], dtype, len(array), array.offset * dtype.itemsize)


# ---- media: bytes in items, one item a file, and by reference (docs/contract.md, "Media")
def _holds_tables(path):
    """Whether a folder holds a .parquet file, or a glob's first match is one."""
    pattern = os.path.join(path, "**", "*.parquet") if os.path.isdir(path) else path
    first = next(glob.iglob(pattern, recursive=True), None)
    return first is not None and first.endswith(".parquet")


def _too_large(name, size):
    return UserError(f"{name}: {size_text(size)} of media, over the limit of {size_text(ITEM_BYTES_MAX)} an item "
                     f"---> HINT: leave it out, or split it into smaller items")


def _media_size(value):
    """The bytes of the bytes values in a Python item (in its dicts and lists too)."""
    kind = type(value)
    if kind is dict:
        return sum(map(_media_size, value.values())) if value else 0
    if kind is list or kind is tuple:
        return sum(map(_media_size, value))
    return memoryview(value).nbytes if kind in (bytes, bytearray, memoryview) else 0


def _fitting(sizes):
    """How many of the first items fit in CLAIM_BYTES (one at least)."""
    total = 0
    for k, size in enumerate(sizes):
        total += size
        if total > CLAIM_BYTES and k:
            return k
    return len(sizes)


def _cut(start, chunk, sizes):
    """(start, stop, items, media bytes) of a claim's chunk cut so that each holds CLAIM_BYTES of
    media at most (one item at least); an item over ITEM_BYTES_MAX is refused."""
    for k, size in enumerate(sizes):
        if size > ITEM_BYTES_MAX:
            raise _too_large(f"item {start + k}", size)
    at = 0
    while at < len(chunk):
        take = _fitting(sizes[at:])
        yield start + at, start + at + take, chunk[at:at + take], sum(sizes[at:at + take])
        at += take


class Blob:
    """A claim's bytes in the bytes form as they are gathered: views of them (one copy: the join),
    and `at`, where each goes ([item, path, start, stop])."""

    def __init__(self):
        self.parts, self.size, self.at = [], 0, []

    def add(self, data):
        """Append bytes (or a view); returns where they start."""
        start = self.size
        self.parts.append(data)
        self.size += memoryview(data).nbytes
        return start


def stage_bytes(backend, run_id, claim, items, blob=None):
    """A claim's items in the bytes form: every bytes value (at any depth of dicts and lists) is
    None in `items` and staged in one object beside the manifest, `at` saying where each goes;
    returns those manifest fields. Never JSON text, never base64, never pickle."""
    blob = blob or Blob()
    items = [_take_bytes(item, k, [], blob) for k, item in enumerate(items)]
    key = f"runs/{run_id}/inputs/{claim}/bytes"
    backend.store.put(key, b"".join(blob.parts))
    return {"items": items, "bytes": {"key": key, "at": blob.at}}


def _take_bytes(value, k, path, blob):
    """`value` with each bytes value None, added to the blob (a function, not a closure: a
    recursive closure is a reference cycle, which kept a claim's bytes alive until a GC ran)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        start = blob.add(value)
        blob.at.append([k, path, start, blob.size])
        return None
    if isinstance(value, dict):   # JSON makes a key text: the path names it so
        return {key: _take_bytes(v, k, path + [str(key)], blob) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_take_bytes(v, k, path + [i], blob) for i, v in enumerate(value)]
    return value


def _without_binary(array, path, blob, first=0):
    """An Arrow array with its binary values (top level, or in structs) null, each added to the blob
    straight from Arrow's buffer (no Python bytes a value: malloc kept those, submit's peak grew
    with the file); None where binary sits deeper (in a list: _take_bytes takes it)."""
    import numpy as np
    import pyarrow as pa
    t = array.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if pa.types.is_fixed_size_binary(t):
            offsets = (np.arange(len(array) + 1) + array.offset) * t.byte_width
            data = array.buffers()[1]
        else:
            kind = np.int64 if pa.types.is_large_binary(t) else np.int32
            offsets = np.frombuffer(array.buffers()[1], kind, len(array) + 1, array.offset * kind().itemsize)
            data = array.buffers()[2]
        base = blob.add(memoryview(data)[offsets[0]:offsets[-1]] if data is not None else b"") - int(offsets[0])
        for k in np.flatnonzero(np.asarray(array.is_valid())).tolist():
            blob.at.append([first + k, path, base + int(offsets[k]), base + int(offsets[k + 1])])
        return pa.nulls(len(array))
    if pa.types.is_struct(t) and _holds_binary(pa, t):
        children = [_without_binary(child, path + [t.field(i).name], blob, first)
                    for i, child in enumerate(array.flatten())]
        if any(child is None for child in children):
            return None
        return pa.StructArray.from_arrays(children, fields=[pa.field(t.field(i).name, c.type) for i, c in
                                                             enumerate(children)], mask=array.is_null())
    return None if _holds_binary(pa, t) else array


def _glob_regex(pattern):
    """A regex of a glob over '/'-separated paths: * and ? within a name, [...] a class, ** any
    folders (fnmatch's * would cross a '/')."""
    out, parts = [], pattern.split("/")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(".+" if last else "(?:[^/]+/)*")
            continue
        k = 0
        while k < len(part):
            c, end = part[k], part.find("]", k + 2)
            if c == "[" and end > 0:
                body = part[k + 1:end]
                out.append("[" + ("^" + body[1:] if body[0] == "!" else body).replace("\\", "\\\\") + "]")
                k = end
            else:
                out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
            k += 1
        out.append("" if last else "/")
    return re.compile("".join(out))


def walk_folder(folder, prefix=""):
    """(path under `folder`, size, mtime in ns) of each file below it in path order, a folder's
    names read at a time; hidden files and folders (a name starting with '.') skipped, links to
    files followed, links to folders not (no cycles)."""
    try:
        with os.scandir(os.path.join(folder, prefix)) as entries:
            names = sorted((e.name + "/" if e.is_dir(follow_symlinks=False) else e.name)
                           for e in entries if not e.name.startswith("."))
    except OSError as e:
        raise UserError(f"cannot read folder {os.path.join(folder, prefix)}: {e.strerror}") from None
    for name in names:
        if name.endswith("/"):
            yield from walk_folder(folder, prefix + name)
            continue
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):   # gone, or a dangling link
            seen = os.stat(os.path.join(folder, prefix, name))
            if stat.S_ISREG(seen.st_mode):
                yield prefix + name, seen.st_size, seen.st_mtime_ns


class FileItems:
    """One item a file, {"path": its path under the folder, glob root or prefix given, "bytes": its
    content}: a local folder or glob, or an s3:// prefix or glob, listed as a stream in path order
    (a prefix of a million objects: claims go out while the listing goes on), hidden files and
    folders skipped. By reference (`refs`) where the workers can read the source, else copied
    (`bytes`, CLAIM_BYTES a claim): media_form decides."""
    media, by_reference = True, True

    def __init__(self, where, bucket, root, pattern):
        self.where, self.bucket, self.root, self.pattern = where, bucket, root, pattern
        self.source = None if bucket else LocalStore(root or ".", Requests())

    @classmethod
    def open(cls, path, columns=None):
        if columns:
            raise UserError(f"--columns applies to Parquet or Arrow input, not to the files of {path}")
        bucket, key = path[len("s3://"):].partition("/")[::2] if path.startswith("s3://") else (None, path)
        parts = key.split("/")
        magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
        root, pattern = "/".join(parts[:magic]), "/".join(parts[magic:])
        if bucket is None and not os.path.isdir(root or "."):
            raise unreadable_items(path, FileNotFoundError(2, "no such folder"))
        return cls(path, bucket, root.rstrip("/") if bucket is not None or root != "/" else root,
                   _glob_regex(pattern) if pattern else None)

    def uri(self):
        """The source as a manifest's `refs` names it: its folder or prefix, ending in '/'."""
        if self.bucket is not None:
            return f"s3://{self.bucket}/{self.root}/" if self.root else f"s3://{self.bucket}/"
        return "file://" + os.path.join(os.path.abspath(self.root or "."), "")

    def entries(self):
        """(path, size, version: ETag or mtime ns) of each file; none at all is a UserError."""
        listed = self.source.walk() if self.bucket is not None else walk_folder(self.source.root)
        found = (e for e in listed if e[0] and not e[0].endswith("/") and  # an S3 folder marker is no file
                 not any(p.startswith(".") for p in e[0].split("/")) and
                 (self.pattern is None or self.pattern.fullmatch(e[0])))
        try:
            first = next(found, None)
        except Exception as e:   # a bucket misspelt, or one this machine may not list
            if _aws_error_info(e).get("Code") not in ("NoSuchBucket", "AccessDenied"):
                raise
            raise UserError(f"{self.where}: {aws_error_line(e)} ---> HINT: check the bucket's name, and that "
                            f"this machine's credentials may list it") from None
        if first is None:
            raise UserError(f"{self.where}: no file there (hidden ones are skipped) ---> HINT: give a folder "
                            f"of files, a quoted glob such as 'photos/**/*.jpg', or an s3:// prefix")
        return itertools.chain([first], found)

    def chunks(self, sizes):
        """(start, stop, entries, media bytes) of each claim (sizes: ClaimSizes, the listing read
        ahead to count the rest), fewer where copied files pass CLAIM_BYTES; a file over
        ITEM_BYTES_MAX refused by name."""
        it, start = Lookahead(self.entries(), sizes.ahead()), 0
        while chunk := list(itertools.islice(it, sizes.next(it.left()))):
            for name, n, _ in chunk:
                if n > ITEM_BYTES_MAX:
                    raise _too_large(f"{self.where}: {name}", n)
            yield from _cut(start, chunk, [0 if self.by_reference else n for _, n, _ in chunk])
            start += len(chunk)

    def stage(self, backend, run_id, claim, start, chunk):
        """By reference: `refs`, the objects named with their size and version; else their bytes."""
        if self.by_reference:
            return {"refs": {"source": self.uri(), "objects": [list(e) for e in chunk]}}
        items = []
        for name, _, _ in chunk:
            try:
                items.append({"path": name, "bytes": self.source.get(name)})
            except NotFound:
                raise UserError(f"{self.where}: {name} vanished while submit read it") from None
        return stage_bytes(backend, run_id, claim, items)


def media_form(backend, record, items, grant=None):
    """Stage media by reference where the workers can read it (a local folder or Parquet file with
    the local store, an s3:// prefix with an s3:// store), else copied, said in one line; an s3://
    prefix is then `grant`ed to the pool's workers (its fleet's grant_read: EC2's role)."""
    if isinstance(items, TableItems):
        items.by_reference = bool(items.media and items.files and backend.kind == "local")
        if items.media and items.files and not items.by_reference:
            print(f"calque: {items.source}: its media are copied into the store: the workers of {backend.describe()} "
                  f"cannot read this machine's files", file=sys.stderr)
        return
    if not isinstance(items, FileItems):
        return
    if items.bucket is None:
        items.by_reference = backend.kind == "local"
        if not items.by_reference:
            print(f"calque: {items.where}: its files are copied into the store: the workers of "
                  f"{backend.describe()} cannot read this machine's folder ---> HINT: upload it (aws s3 sync) "
                  f"and submit its s3:// prefix to have it read where it is", file=sys.stderr)
        return
    if backend.kind != "aws":
        raise UserError(f"{items.where}: an s3:// input needs an s3:// store, whose workers read it where it is "
                        f"---> HINT: CALQUE_STORE=s3://bucket/prefix, or copy the files here and submit the folder")
    inside = backend.store.uri("")
    if items.uri().startswith(inside) or inside.startswith(items.uri()):
        raise UserError(f"{items.where}: it overlaps the calque store {backend.describe()}: a run reads no "
                        f"other run's objects ---> HINT: keep inputs under another prefix")
    items.source = S3Store(backend.store.s3, items.bucket, items.root, backend.requests,
                           backend.store.endpoint_retry)
    if grant:
        grant(record, items.uri())


def rows_items(rows):
    """The items of a by-reference Parquet row range (a manifest's `rows`), as a staged table's
    would arrive; each row of a file that changed or vanished since submit is an Unavailable
    naming it. A worker imports pyarrow for such claims only."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    items = []
    for uri, size, mtime_ns, start, stop in rows["files"]:
        if not uri.startswith("file:///"):
            raise ValueError(f"{uri!r} is not a file:// URI")
        path = uri[len("file://"):]
        try:
            unchanged(os.stat(path), size, mtime_ns)
            table = _row_range(pq.ParquetFile(path), start, stop, rows["columns"])
            unchanged(os.stat(path), size, mtime_ns)   # and after: a file replaced meanwhile too
            items += table_items(table, start, path)
        except FileNotFoundError:
            items += [Unavailable(f"{path}: vanished since submit")] * (stop - start)
        except Changed as e:
            items += [Unavailable(f"{path}: changed since submit ({e})")] * (stop - start)
        except (OSError, pa.ArrowException, UserError) as e:
            items += [Unavailable(f"{path}: cannot read rows {start}-{stop - 1} ({e})")] * (stop - start)
    return items


def _row_range(f, start, stop, columns):
    """Rows [start, stop) of a ParquetFile: only the row groups that hold them are read, a batch
    at a time."""
    import pyarrow as pa
    groups, first, at = [], None, 0
    for g in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if at < stop and at + n > start:
            groups.append(g)
            first = at if first is None else first
        at += n
    batches, skip, want = [], start - (first or 0), stop - start
    for batch in f.iter_batches(row_groups=groups, columns=columns, use_threads=False):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        batches.append(batch.slice(skip, want))
        skip, want = 0, want - batches[-1].num_rows
        if not want:
            break
    if want:
        raise Changed(f"rows {start}-{stop - 1} are no longer all there")
    return pa.Table.from_batches(batches, pa.schema([f.schema_arrow.field(c) for c in columns]))


def table_items(table, start, source):
    """A table's rows as items, as TableItems stages them and a worker receives them: numeric
    columns as numpy values, the rest as Python values (binary as bytes, times as ISO text)."""
    import pyarrow as pa
    numeric = [n for n in table.column_names if _column_kind(pa, table.schema.field(n).type) == "numeric"]
    json = [n for n in table.column_names if n not in numeric]
    items = ([dict(zip(json, row)) for row in zip(*(_json_column(table.column(n)) for n in json))] if json
             else [{} for _ in range(table.num_rows)])
    fields = {}
    for name in numeric:
        roles = _numeric_column(table.column(name).combine_chunks(), name, start, source)
        fields[name] = (roles["values"], roles.get("offsets"), roles.get("valid"))
    return merge_fields(items, fields)


class SubmitInterrupted(BaseException):
    """SIGINT or SIGTERM while submit or runs resume stages or sends claims; a BaseException."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt():
    """Inside the block SIGINT and SIGTERM raise SubmitInterrupted once; a second one is ignored, so
    that recording what was sent is not cut short."""
    fired = []

    def on_signal(signum, frame):
        if not fired:
            fired.append(signum)
            raise SubmitInterrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block is done (blocked for this thread meanwhile)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def run_options(id_field=None, timeout=None, wait_for_workers=False, plan=None):
    """The submit options a run keeps, given ones only: its record's `options`, written before its
    first claim is sent, so that runs resume, redrive and its results honour them after any Ctrl-C
    (docs/contract.md, "A run keeps its options")."""
    given = {"id_field": id_field, "timeout": timeout, "wait_for_workers": wait_for_workers,
             "plan": plan}
    return {name: value for name, value in given.items() if value not in (None, False)}


class ClaimSizes:
    """Each claim's size, asked claim by claim as a run is cut (claim_chunks): `fixed` (--claim-size,
    CALQUE_CLAIM_SIZE), else factoring: stages of `workers` claims of ceil(rest / (2 workers)) items
    each, within [lo, hi], so every worker stays busy to the end and the last claims are the shortest;
    the last stage splits the rest evenly (claims of lo/2 at least) where less than lo would be left.
    Counted in whole batches of `unit` items where a batch fits within hi: a claim of 75 items in
    batches of 32 pays for three generate calls, 96 for the same three.
    `why` is the run record's one-line reason (runs show prints it)."""

    def __init__(self, fixed=None, workers=1, lo=1, hi=CLAIM_SIZE_MAX, unit=1, why=""):
        self.fixed, self.workers, self.why = fixed, max(1, workers), why
        self.unit = unit if 1 <= unit <= hi else 1
        self.hi = max(1, hi // self.unit) * self.unit
        self.lo = min(max(1, lo), self.hi)   # the claim duration target wins over the overhead floor
        self.size, self.given = None, 0

    def next(self, left):
        """The next claim's size; `left`: the items not cut yet, None where more than `ahead()` are."""
        if self.fixed:
            return self.fixed
        if self.given % self.workers == 0:   # a new stage, in units
            lo, hi, w = -(-self.lo // self.unit), self.hi // self.unit, self.workers
            rest = None if left is None else -(-left // self.unit)
            self.size = hi if rest is None else min(hi, max(lo, -(-rest // (2 * w))))
            if rest is not None and rest - w * self.size < lo:   # the last stage: the rest split evenly,
                shares = max(1, min(w, rest // max(1, lo // 2)))   # claims of lo/2 at least: none left alone
                self.size = max(1, min(hi, -(-rest // shares)))   # (none left: a table's cut asks once more)
        self.given += 1
        return self.size * self.unit

    def plan(self, total):
        """The sizes of a run of `total` items (where no media cuts a claim short)."""
        if self.fixed:
            return [self.fixed] * (total // self.fixed) + ([total % self.fixed] if total % self.fixed else [])
        fresh, sizes, left = ClaimSizes(None, self.workers, self.lo, self.hi, self.unit), [], total
        while left > 0:
            sizes.append(min(fresh.next(left), left))
            left -= sizes[-1]
        return sizes

    def ahead(self):
        """Items a stream is read ahead of its claims, so that `left` is known where it matters."""
        return 0 if self.fixed else min(CLAIM_LOOKAHEAD_MAX, 2 * self.workers * self.hi)


def as_sizes(size):
    """A ClaimSizes from an int (a fixed size) or a ClaimSizes."""
    return size if isinstance(size, ClaimSizes) else ClaimSizes(fixed=size)


class Lookahead:
    """An iterator that reads `n` items ahead of its consumer: `left()` counts the rest once the
    source ends within them (None before), for a stream's claim sizes."""

    def __init__(self, source, n):
        self.source, self.n, self.held, self.ended = iter(source), n, collections.deque(), n == 0

    def __iter__(self):
        return self

    def __next__(self):
        if not self.held:
            self._fill()
        if self.held:
            return self.held.popleft()
        return next(self.source)   # n == 0: the source as it is

    def left(self):
        self._fill()
        return len(self.held) if self.ended else None

    def _fill(self):
        while not self.ended and len(self.held) < self.n:
            try:
                self.held.append(next(self.source))
            except StopIteration:
                self.ended = True


def claim_chunks(items, size):
    """(start, stop, items or None, media bytes) of each claim, sized by `size` (an int or a
    ClaimSizes), fewer where their bytes values pass CLAIM_BYTES (arrays, tables, files: their own)."""
    sizes = as_sizes(size)
    if isinstance(items, (ArrayItems, TableItems, FileItems)):
        yield from items.chunks(sizes)
        return
    start = 0
    if isinstance(items, list):
        it, left = iter(items), lambda: len(items) - start
    else:
        it = Lookahead(items, sizes.ahead())
        left = it.left
    while chunk := list(itertools.islice(it, sizes.next(left()))):
        yield from _cut(start, chunk, [0 if type(item) is JsonText else _media_size(item) for item in chunk])
        start += len(chunk)


class HoldsBytes(Exception):
    """A Python item holds bytes: its claim is staged in the bytes form (stage_bytes)."""


def _no_bytes(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise HoldsBytes
    return to_jsonable(value)


def stage_claim(backend, run, items, claim, start, stop, chunk):
    """Write one claim's manifest (JSON items inside, numeric items beside it as .npy, bytes values
    beside it in one object; by reference, what the worker fetches)."""
    manifest = {"run_id": run["run_id"], "claim": claim, "model": run["model"], "first_index": start,
                "count": stop - start}
    if chunk is None:
        manifest["arrays"] = items.stage(backend, run["run_id"], claim, start, stop)
    elif isinstance(items, (TableItems, FileItems)):
        manifest.update(items.stage(backend, run["run_id"], claim, start, chunk))
    elif all(type(item) is JsonText for item in chunk):   # checked JSONL lines: joined as they are
        body = dumps(manifest)
        backend.store.put(manifest_key(run["run_id"], claim), f'{body[:-1]},"items":[{",".join(chunk)}]}}')
        return
    else:
        try:
            body = json.dumps(dict(manifest, items=chunk), default=_no_bytes, separators=(",", ":"))
        except HoldsBytes:
            manifest.update(stage_bytes(backend, run["run_id"], claim, chunk))
        else:
            return backend.store.put(manifest_key(run["run_id"], claim), body)
    backend.store.put(manifest_key(run["run_id"], claim), dumps(manifest))


def stage_run(backend, record, items, claim_size, queue, mode, run_id=None, options=None,
              grant=None):
    """Stage the items as a stream, sending each claim once its manifest has landed; returns the
    run, its claims sized by `claim_size` (an int, or a ClaimSizes). The run record comes first
    (`staged: false`, with the submit `options` it keeps: run_options); claims are cut as items
    are read, manifests PUT on STORE_WRITERS threads (LOCAL_WRITERS locally) and sent in order,
    SEND_BATCH a request, with at most STAGE_AHEAD manifests a writer unsent (bounded memory).
    SIGINT or SIGTERM stops the sending, not the staging (`runs resume` sends the rest), then
    raises SubmitInterrupted. Another error before a claim was sent deletes what was staged;
    after, the run keeps the claims sent. `grant`: media_form's (the fleet's grant_read)."""
    run_id = run_id or new_run_id(record["model"])
    media_form(backend, record, items, grant)
    known = len(items) if isinstance(items, (ArrayItems, TableItems, list)) else None
    sizes = as_sizes(claim_size)
    planned = sizes.plan(known) if known else []
    claim_size = sizes.fixed or sizes.hi   # the largest claim
    run = {"run_id": run_id, "model": record["model"], "mode": mode, "items": known or 0,
           "claims": [claim_id(i) for i in range(len(planned))], "claim_size": claim_size,
           "queue": queue.name, "backend": backend.kind, "store": backend.describe(),
           "created_at": now_iso(), "sent": 0, "staged": False, "options": options or {},
           **_claim_counts(planned, claim_size)}
    if record.get("version"):   # the only version whose workers run its claims
        run["version"] = record["version"]
    if sizes.why:
        run["sizing"] = sizes.why
    landed, pending, count, sending, counts = [], collections.deque(), 0, True, []
    # signals wait until the end (sigpending between two claims): a claim is never half cut
    with signals_deferred():
        try:
            write_json(backend, run_key(run_id), run)
            writer_count = LOCAL_WRITERS if backend.kind == "local" else STORE_WRITERS
            with ThreadPoolExecutor(writer_count) as writers:
                for index, (start, stop, chunk, media) in enumerate(claim_chunks(items, sizes)):
                    claim, count = claim_id(index), stop
                    if index == len(run["claims"]):   # a stream's, or one more where media cut a claim short
                        run["claims"].append(claim)
                    counts.append(stop - start)
                    pending.append((claim, writers.submit(stage_claim, backend, run, items, claim, start, stop,
                                                          chunk), media))
                    sending = sending and not {signal.SIGINT, signal.SIGTERM} & signal.sigpending()
                    first = sending and run["sent"] == 0 and not landed
                    full = len(pending) >= writer_count * STAGE_AHEAD or sum(p[2] for p in pending) >= STAGE_BYTES
                    _send_landed(backend, run, queue, pending, landed, sending, wait=first or full, flush=first)
                if not count:
                    raise UserError("no items to submit")
                while pending or landed:
                    _send_landed(backend, run, queue, pending, landed, sending, wait=True, flush=True)
            update_run(backend, run, claims=run["claims"][:len(counts)], items=count, sent=run["sent"],
                       staged=True, **_claim_counts(counts, claim_size))
        except BaseException as e:
            if not run["sent"]:
                backend.store.delete_prefix(f"runs/{run_id}/")   # a cold run's handler too: no run
                raise
            kept = sum(counts[:run["sent"]])
            update_run(backend, run, claims=run["claims"][:run["sent"]], items=kept, sent=run["sent"], staged=True,
                       **_claim_counts(counts[:run["sent"]], claim_size))
            if isinstance(e, (UserError, StoreFault)):
                raise type(e)(f"run {run_id} stopped after queueing {run['sent']} claim(s) (items "
                              f"0 to {kept - 1}; the run keeps them): {e}") from None
            raise
    return run


def _claim_counts(counts, claim_size):
    """The run record's `claim_counts` where claims differ from claim_size (sized to the run, or
    media cut them short: claim_items)."""
    return {"claim_counts": counts} if any(n != claim_size for n in counts[:-1]) else {}


def _send_landed(backend, run, queue, pending, landed, sending, wait, flush):
    """Move the landed manifests at the head of `pending` to `landed` (the head one awaited when
    `wait`), then send them in order, SEND_BATCH a request (a partial batch when `flush`)."""
    while pending and (wait or pending[0][1].done()):
        claim, future, _ = pending.popleft()
        future.result()
        landed.append(claim)
        wait = False
    while sending and landed and (len(landed) >= SEND_BATCH or flush):
        batch, landed[:SEND_BATCH] = landed[:SEND_BATCH], []
        send_batch(backend, run, queue, batch)
        run["sent"] += len(batch)
    if not sending:
        landed.clear()


def send_batch(backend, run, queue, claims, resume=False):
    """One queue request (SendMessageBatch on SQS) for these claims of the run."""
    run_id = run["run_id"]
    queue.send_batch([make_message(run_id, run["model"], backend.store.uri(manifest_key(run_id, c)), c,
                                   resume, run.get("version")) for c in claims])


def send_claims(backend, run, queue, skip=(), resume=False):
    """Send the run's claims from run["sent"] on, but `skip`, recording how far it got whatever
    stops it. A claim sent twice (after a kill -9) is acked by its worker as a duplicate."""
    try:
        while run["sent"] < len(run["claims"]):
            with signals_deferred():   # a send and its count are one step
                batch = run["claims"][run["sent"]:run["sent"] + SEND_BATCH]
                todo = [claim for claim in batch if claim not in skip]
                if todo:
                    send_batch(backend, run, queue, todo, resume)
                run["sent"] += len(batch)
    finally:
        update_run(backend, run, sent=run["sent"])


def interrupted(backend, run_id, signum):
    """Say what an interrupted submit or runs resume left; returns 128 + the signal."""
    try:
        run = _run_defaults(read_json(backend, run_key(run_id)))
    except NotFound:
        print(f"calque: interrupted while staging run {run_id}: nothing was queued ---> HINT: submit again",
              file=sys.stderr)
    else:
        total = len(run["claims"])
        print(f"calque: interrupted: run {run_id}: {run['sent']} of {total} claim(s) queued (they "
              f"finish without you), {total - run['sent']} not sent ---> HINT: {command()} "
              f"runs resume {run_id}", file=sys.stderr)
    return 128 + signum


def interrupted_waiting(run_id):
    """Say that a submit or runs resume interrupted while it waits leaves the run going on."""
    print(f"calque: interrupted while waiting: run {run_id}: its claims are queued and finish without "
          f"you ---> HINT: {command()} runs show {run_id}", file=sys.stderr)
    return 128 + signal.SIGINT


def run_dlq_name(run):
    """The dead-letter queue of the run's claims: its pool's, or a cold run's own."""
    return dlq_name(run["model"]) if run["mode"] == "pool" else run_queue_names(run["run_id"])[1]


def receive_all(queue, count):
    """Up to `count` messages of the queue, received (hidden until deleted or released)."""
    messages = []
    while len(messages) < count and (message := queue.receive(DLQ_SCAN_WAIT)) is not None:
        messages.append(message)
    return messages


def release(queue, messages):
    """Make received messages visible again at once (a stale receipt's message is back already)."""
    for message in messages:
        with contextlib.suppress(LeaseLost):
            queue.change_visibility(message, 0)


def dead_letter_of(message):
    """(run id, claim, reason) of a dead-letter message, or None when its body names no claim."""
    try:
        letter = json.loads(message.body)
        if isinstance(letter, dict) and "body" not in letter:   # moved as sent, by SQS (the backstop)
            letter = {"body": message.body, "reason": "moved by the queue's redrive policy (the "
                      "backstop): received that many times and no worker ended it; their logs say why"}
        original = parse_message(letter["body"])
        return original["run_id"], original["claim"], str(letter.get("reason", "?"))
    except (ValueError, KeyError, TypeError):
        return None


class DeadLetters:
    """The claims of one run in its dead-letter queue ({claim: reason}), found by receiving and
    releasing every message; rescanned only when the depth changed or others held messages."""

    def __init__(self, backend, run):
        self.backend, self.run_id, self.name = backend, run["run_id"], run_dlq_name(run)
        self.queue, self.depth, self.found = None, None, {}

    def claims(self):
        try:
            self.queue = self.queue or self.backend.queues.open_queue(self.name)
        except NotFound:   # deleted (an ended cold run's, a deleted pool's): it holds nothing
            return {}
        counts = self.queue.counts()
        if counts["visible"] + counts["in_flight"] != self.depth or counts["in_flight"]:
            self.depth = counts["visible"] + counts["in_flight"]
            messages = receive_all(self.queue, counts["visible"])
            release(self.queue, messages)
            letters = [dead_letter_of(m) for m in messages]
            self.found = {c: why for rid, c, why in filter(None, letters) if rid == self.run_id}
        return self.found


def wait_for_run(backend, run, timeout, progress=True, stop_if=None, interrupted=()):
    """Poll the run's summaries until every claim has one, nothing can run the rest, or timeout;
    returns (summaries, timed_out). `run` follows its stored record; stop_if() may raise, and a
    non-empty `interrupted` (sigint_noted) raises KeyboardInterrupt. Each LIST
    starts after the last claim below which all are done; its gap grows from SUMMARY_POLL_MIN by
    half while none land, up to SUMMARY_WAIT_MAX, and after new ones is what SUMMARY_BATCH more take
    at the rate so far. The run record and the DLQ are read only on a stall (run_recheck)."""
    from tqdm import tqdm
    started = time.monotonic()
    deadline, progressed, recheck = started + timeout, started, run_recheck(started, started)
    done, dead = {}, DeadLetters(backend, run)
    in_key_order, below = sorted(run["claims"], key=lambda c: summary_key(run["run_id"], c)), 0
    delay = SUMMARY_POLL_MIN
    wait_max = min(SUMMARY_WAIT_MAX, LOCAL_SUMMARY_WAIT if backend.kind == "local" else math.inf)
    bar = tqdm(total=run["items"], unit="item", file=sys.stderr, disable=not progress, leave=False,
               desc=f"run {run['run_id']}")
    finished, running = 0, {}   # items of the claims done; {claim: items done} of long running ones
    try:
        while True:
            while below < len(in_key_order) and in_key_order[below] in done:
                below += 1
            found = 0
            for key in list_summaries(backend, run["run_id"], in_key_order[below - 1] if below else None):
                claim = key.rsplit("/", 1)[1][:-5]
                if claim not in done:
                    done[claim] = read_json(backend, key)
                    finished += done[claim]["items"]
                    running.pop(claim, None)
                    found += 1
            if found:
                bar.update(finished + sum(running.values()) - bar.n)
            now = time.monotonic()
            if len(done) == len(run["claims"]) or now >= deadline:
                break
            if found:
                progressed, recheck = now, run_recheck(now, now)
                rate = len(done) / max(now - started, SUMMARY_POLL_MIN)   # claims a second
                expected = min(SUMMARY_BATCH, len(run["claims"]) - len(done))
                delay = min(max(expected / rate, SUMMARY_POLL_FLOOR), wait_max)
            else:
                delay = min(delay * 1.5, wait_max)   # quick at first (idle round trip)
            if now >= recheck:
                recheck = run_recheck(progressed, now)
                if progress:   # a long claim's items done count too (claims_progress)
                    running = claims_progress(backend, run["run_id"], [c for c in run["claims"] if c not in done])
                    bar.update(finished + sum(running.values()) - bar.n)
                if nothing_left_to_run(backend, run, done, dead):
                    break
                if stop_if:
                    stop_if()
            if interrupted:
                raise KeyboardInterrupt
            time.sleep(min(delay, deadline - now))
    finally:
        bar.close()
    return [done[c] for c in run["claims"] if c in done], len(done) < len(run["claims"])


@contextlib.contextmanager
def sigint_noted():
    """SIGINT raises KeyboardInterrupt and is noted in the list yielded: Python drops an exception
    raised inside a callback (an import lock's, at garbage collection), so a wait checks the note."""
    noted = []

    def on_sigint(signum, frame):
        noted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


def run_recheck(progressed, now):
    """When wait_for_run next looks at the run record: RUN_RECHECK s after the last new summary,
    then at gaps doubling with the time stalled, up to RUN_RECHECK_MAX."""
    return max(progressed + RUN_RECHECK, now + min(max(now - progressed, RUN_RECHECK), RUN_RECHECK_MAX))


def nothing_left_to_run(backend, run, done, dead):
    """True when no worker can take a claim without a summary: the run was cancelled, or each such
    claim was never sent or is dead-lettered (`dead`). Reads the run record again, into `run`."""
    run.update(_run_defaults(read_json(backend, run_key(run["run_id"]))))
    if run.get("cancelled"):
        return True
    try:
        letters = dead.claims()
    except StoreFault:
        if backend.kind != "local":
            raise
        letters = dead.claims()   # the local queue file was replaced: reopened now
    waiting = [claim for index, claim in enumerate(run["claims"])
               if claim not in done and index < run["sent"] and claim not in letters]
    lost = claims_in_no_queue(backend, run, waiting) if waiting and run["mode"] == "pool" else []
    return len(lost) == len(waiting)


def cancel_run(backend, run, reason):
    """Mark the run cancelled with a `cancelled` summary for each claim without one (a worker acks
    such a claim unrun; one finished meanwhile keeps its own). Returns the claims marked."""
    have = summary_claims(backend, run["run_id"])
    if all(claim in have for claim in run["claims"]):
        return []
    at = time.time()
    update_run(backend, run, cancelled={"reason": reason, "at": now_iso(at)})

    def mark(claim):
        key = summary_key(run["run_id"], claim)
        if backend.store.exists(key):
            return False
        summary = claim_summary(
            run_id=run["run_id"], claim=claim, model=run["model"], worker_id="submitter",
            mode=run["mode"], backend=backend.kind, receive_count=0, enter_count=0, started=at,
            finished=at, requests={}, notes=[f"cancelled ({reason}): the claim was not run"])
        write_json(backend, key, dict(summary, status="cancelled", reason=reason))
        return True

    missing = [claim for claim in run["claims"] if claim not in have]
    with ThreadPoolExecutor(STORE_WRITERS) as writers:
        return [claim for claim, marked in zip(missing, writers.map(mark, missing)) if marked]


def cancel_pool_runs(backend, model):
    """pool delete --force: cancel each unfinished run of the pool; {run id: claims marked}."""
    cancelled = {}
    for run in list_runs(backend, model):
        if run["model"] == model and run["mode"] == "pool":
            marked = cancel_run(backend, run, "pool deleted")
            if marked:
                cancelled[run["run_id"]] = marked
    return cancelled


def live_claims(backend, run):
    """The run's claims queued or running: what deleting it would strand."""
    states = claim_states(backend, run, read_summaries(backend, run["run_id"]))
    return [claim for claim, (state, _) in states.items() if state == "queued or running"]


def check_deletable(backend, run):
    """Refuse to delete a run with claims queued or running (they would be dead-lettered)."""
    live = live_claims(backend, run)
    if live:
        raise UserError(f"run {run['run_id']} has {len(live)} claim(s) queued or running: deleting it would strand "
                        f"them ---> HINT: wait (runs show {run['run_id']}), runs cancel it, or pass --force")


def delete_run(conf, backend, run):
    """Delete a run's objects (and its cold workers' logs here); returns (objects, bytes)."""
    freed = backend.store.delete_prefix(f"runs/{run['run_id']}/")
    shutil.rmtree(os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "runs", run["run_id"]), ignore_errors=True)
    return freed


def parse_age(text):
    """Seconds of an age such as 7d, 12h, 30m, 90s or 2w."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not match:
        raise UserError(f"--older-than {text!r}: not an age ---> HINT: a number and a unit: 90s, 30m, 12h, 7d, 2w")
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match[2]]


def drop_pool(backend, record, cancel=False):
    """Delete a pool's queues and store folder (its runs are kept); `cancel`: its unfinished runs
    first. Its workers are stopped already. Returns the cancelled runs, as cancel_pool_runs."""
    cancelled = cancel_pool_runs(backend, record["model"]) if cancel else {}
    for role in ("queue", "dlq"):
        backend.queues.delete_queue(record[role])
        if backend.kind == "aws":    # a create within the minute waits (SQS still deletes)
            note_queue_deleted(backend.store, record[role])
    backend.store.delete_prefix(f"pools/{record['slug']}/")
    return cancelled


def runs_to_prune(backend, older_than, keep=0, model=None):
    """The runs over `older_than` s old (of `model` if given), but each model's `keep` newest."""
    runs = list_runs(backend, model)
    kept = {r["run_id"] for m in {r["model"] for r in runs}
            for r in [r for r in runs if r["model"] == m][::-1][:keep]}
    cutoff = time.time() - older_than
    return [r for r in runs if r["run_id"] not in kept and
            datetime.datetime.fromisoformat(r["created_at"]).timestamp() < cutoff]


def redrive(backend, record, runs):
    """Send the dead-lettered claims of `runs` back to the pool queue, marked resume: its failure
    summary is deleted first (else a worker would ack it as done), then it is sent, then its DLQ
    copies deleted. Idempotent. Returns {run id: [claims sent]}."""
    queue, dlq = backend.queues.open_queue(record["queue"]), backend.queues.open_queue(record["dlq"])
    letters = receive_all(dlq, dlq.counts()["visible"])
    copies, deleted, sent = {}, set(), {}
    for message in letters:
        found = dead_letter_of(message)
        if found and found[0] in runs:
            copies.setdefault(found[:2], []).append(message)
    try:
        for run_id, run in runs.items():
            summaries = {s["claim"]: s for s in read_summaries(backend, run_id)}
            for claim in run["claims"]:
                s = summaries.get(claim)
                failure = s is not None and s["status"] == "failed" and bool(s.get("error"))
                if failure or (s is None and (run_id, claim) in copies):
                    if failure:
                        backend.store.delete(summary_key(run_id, claim))
                    uri = backend.store.uri(manifest_key(run_id, claim))
                    queue.send(make_message(run_id, run["model"], uri, claim, True,
                                            run.get("version")))
                    sent.setdefault(run_id, []).append(claim)
                for message in copies.get((run_id, claim), []):
                    dlq.delete(message)
                    deleted.add(message.receipt)
    finally:
        release(dlq, [m for m in letters if m.receipt not in deleted])
    return sent


def claim_parts(backend, run_id, claim, count):
    """The claim's result parts in item order (a calque 0.2 claim's one results object instead)."""
    try:
        return read_claim_parts(backend.store, run_id, claim, count)
    except ResultsIncomplete:
        if backend.store.list(results_prefix(run_id, claim)):
            raise
        try:
            lines = backend.store.get(results_key(run_id, claim)).decode().splitlines(keepends=True)
        except NotFound:
            raise ResultsIncomplete(f"run {run_id} claim {claim}: no result part under "
                                    f"{results_prefix(run_id, claim)}")
        if len(lines) != count or not lines[-1].endswith("\n"):
            raise ResultsIncomplete(f"run {run_id} claim {claim}: {results_key(run_id, claim)} is "
                                    f"truncated ({len(lines)} of {count} lines)")
        return [Part(lines, [])]


def claim_results(backend, run_id, claim, count):
    """The claim's result lines, in item order, as JSONL prints them."""
    return [ln for p in claim_parts(backend, run_id, claim, count) for ln in result_lines(p)]


def claim_ids(backend, run, claim, field, manifest=None):
    """The `field` of each of the claim's items, read from its manifest (by reference: a file's
    path, a Parquet column's values; a bytes value reads as null)."""
    manifest = manifest or json.loads(backend.store.get(manifest_key(run["run_id"], claim)))
    if "refs" in manifest:
        return [name for name, _, _ in manifest["refs"]["objects"]]
    items = (rows_items(dict(manifest["rows"], columns=[field])) if "rows" in manifest else
             array_items(backend.store, manifest) if "arrays" in manifest else manifest["items"])
    values = [item[field] if isinstance(item, dict) else None for item in items]   # else: Unavailable
    return [getattr(v, "tolist", lambda v=v: v)() for v in values]   # numpy values as plain ones


def claim_column(parts, field):
    """(offsets, values) of the items whose result holds `field` (None: the result itself): typed
    arrays stacked (bfloat16 as float32), else as numpy.array makes them; ValueError on shapes."""
    import numpy as np
    blocks, lines, at = [], [], 0
    for part in parts:
        blocks += [b._replace(rows=b.rows + at) for b in part.blocks if b.field == field]
        lines += part.lines
        at += len(part.lines)
    if blocks:
        if any(b.dtype == BYTES for b in blocks):
            raise ValueError("its values are bytes")
        if any(b.shapes is not None for b in blocks) or len({b.values.shape[1:] for b in blocks}) > 1:
            raise ValueError("its arrays differ in shape from item to item")
        if len(blocks) == 1:
            return blocks[0].rows, blocks[0].widen()
        rows, values = np.concatenate([b.rows for b in blocks]), np.concatenate([b.widen() for b in blocks])
        order = np.argsort(rows, kind="stable")
        return rows[order], values[order]
    rows, values = [], []
    for k, line in enumerate(map(orjson.loads, lines)):
        value = line.get("result")
        value = value if field is None else value.get(field) if isinstance(value, dict) else None
        if line["ok"] and value is not None:
            rows.append(k)
            values.append(value)
    values = np.array(values)
    if values.dtype.kind not in NUMERIC_KINDS:
        raise ValueError(f"its values are not numbers: numpy makes {values.dtype} of them")
    return np.array(rows, dtype=np.int64), values


def typed_fields(parts):
    """The fields the parts' typed blocks hold (None: the result itself), in the order first met."""
    return list(dict.fromkeys(b.field for part in parts for b in part.blocks))


def result_fields(parts):
    """{field: whether it holds numbers} of the parts' ok results, as first met: their dicts' keys
    (typed ones too: null in the lines), None for a result that is no dict."""
    arrays, fields = {b.field for part in parts for b in part.blocks if b.dtype != BYTES}, {}
    for line in map(orjson.loads, (line for part in parts for line in part.lines)):
        if line["ok"]:
            result = line["result"]
            for key, value in result.items() if isinstance(result, dict) else [(None, result)]:
                fields[key] = fields.get(key) or key in arrays or holds_numbers(value)
    return fields


def holds_numbers(value):
    """A JSON value that stacks into a numeric array: a number, or a list of them (nested)."""
    while isinstance(value, list) and value:
        value = value[0]
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def with_parts(backend, run, claims):
    """(index, claim, its parts) for each (index, claim) of `claims`."""
    for index, claim in claims:
        yield index, claim, claim_parts(backend, run["run_id"], claim, claim_items(run, index))


def run_array(run, claims, field=None, fill=None):
    """One array of `field` (None: the result, or its only array) over `claims` ((index, claim,
    parts)); a row without it is `fill` (default NaN for floats, else a UserError)."""
    import numpy as np
    pieces, missing, choose, there = [], 0, field is None, {}
    for index, claim, parts in claims:
        if choose and typed_fields(parts):      # the first claim with arrays says which
            choose, names = False, typed_fields(parts)
            if len(names) > 1 and None not in names:
                raise UserError(f"run {run['run_id']}: results hold several arrays ({', '.join(names)}) "
                                f"---> HINT: name one: to_numpy({names[0]!r}), or runs results --field {names[0]}")
            field = None if None in names else names[0]
        try:
            rows, values = claim_column(parts, field)
        except ValueError as e:
            raise UserError(f"run {run['run_id']} claim {claim}: {field or 'the result'} cannot stack into one array "
                            f"({e}) ---> HINT: read it with to_arrow() or runs results --format parquet")
        pieces.append((claim_items(run, index), rows, values))
        missing += claim_items(run, index) - len(rows)
        if field is not None and not len(rows):   # what it has instead, should no claim have it
            there.update(result_fields(parts))
    if field is not None and not any(len(rows) for _, rows, _ in pieces):
        names = [f for f in there if f is not None]
        have, numbers = ", ".join(map(repr, names)), [f for f in names if there[f]]
        why = (f"its results have {have} ---> HINT: to_numpy({numbers[0]!r}), or {command()} runs "
               f"results {run['run_id']} --format npy --field {numbers[0]}" if numbers else
               f"its results have {have}, none of them numbers ---> HINT: read them with "
               f"to_arrow() or `{command()} runs results {run['run_id']}`" if names else
               "its results are not dicts ---> HINT: to_numpy() reads the result itself" if None in there else
               f"no item succeeded ---> HINT: {command()} runs show {run['run_id']}")
        raise UserError(f"run {run['run_id']}: no result has the field {field!r}: {why}")
    shape, dtype = next(((v.shape[1:], v.dtype) for _, _, v in pieces if len(v)), ((), np.dtype("float64")))
    if missing and fill is None and dtype.kind != "f":
        raise UserError(f"run {run['run_id']}: {missing} items have no {field or 'result'} (failed, or none in "
                        f"their result) and {dtype} has no NaN for their rows ---> HINT: pass "
                        f"fill= (runs results --fill), or read the ok column with to_arrow()")
    out, at = np.empty((sum(n for n, _, _ in pieces), *shape), dtype=dtype), 0
    for count, rows, values in pieces:
        if len(values) and values.shape[1:] != shape:
            raise UserError(f"run {run['run_id']}: {field or 'the result'} is {values.shape[1:]} "
                            f"in some claims, {shape} in others ---> HINT: read it with to_arrow()")
        if len(rows) == count:          # every item has it: rows are 0..count-1 in order
            out[at:at + count] = values
        else:
            out[at:at + count] = fill if fill is not None else np.nan if dtype.kind == "f" else 0
            if len(rows):
                out[at + rows] = values
        at += count
    return out


def _arrow_column(pa, values):
    """A pyarrow array of stacked numpy values: a fixed-size list level per inner dimension."""
    column = pa.array(values.reshape(-1))
    for size in reversed(values.shape[1:]):
        column = pa.FixedSizeListArray.from_arrays(column, size)
    return column


def claim_batch(backend, run, claim, parts):
    """The claim's results as a pyarrow.RecordBatch: i, ok, error, the id field, then a column a key
    where every result is a dict (a clash gets "result."), else `result`. Typed arrays become
    fixed-size lists; JSON values as pyarrow infers them, else their JSON text."""
    import numpy as np
    import pyarrow as pa
    lines = orjson.loads("[" + ",".join(line[:-1] for part in parts for line in part.lines) + "]")
    count = len(lines)
    columns = {"i": pa.array([line["i"] for line in lines], pa.int64()),
               "ok": pa.array([line["ok"] for line in lines]),
               "error": pa.array([line.get("error") for line in lines], pa.string())}
    field = run["options"].get("id_field")
    if field:
        columns[field] = pa.array(claim_ids(backend, run, claim, field))
    typed, results = typed_fields(parts), [line["result"] for line in lines if line["ok"]]
    keyed = results and None not in typed and all(isinstance(r, dict) for r in results)
    for field in dict.fromkeys(k for r in results for k in r) if keyed else [None] if results else []:
        name = "result" if field is None else field if field not in columns else f"result.{field}"
        def value(line, field=field):
            result = line.get("result")
            return result if field is None else (result or {}).get(field)
        if field in typed:
            try:
                rows, stacked = claim_column(parts, field)
            except ValueError:      # shapes that differ: one list a row, below
                rows = None
            if rows is not None and (len(rows) == count or not any(
                    value(lines[k]) is not None for k in set(range(count)) - set(rows.tolist()))):
                columns[name] = _arrow_column(pa, stacked)
                if len(rows) < count:   # the items without it (failed) are nulls
                    where = np.full(count, -1)
                    where[rows] = np.arange(len(rows))
                    columns[name] = columns[name].take(pa.array(where, mask=where < 0))
                continue
        values = [value(line) for line in lines]
        for row, array in zip(*claim_column_rows(parts, field)):
            values[row] = array if isinstance(array, bytes) else array.tolist()
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            columns[name] = pa.array([None if v is None else bytes_text(v) if isinstance(v, bytes) else dumps(v)
                                      for v in values], pa.string())
    return pa.record_batch(columns)


def claim_column_rows(parts, field):
    """(offsets, arrays) of the claim's typed values of `field`, one array a row."""
    rows, arrays, at = [], [], 0
    for part in parts:
        for block in part.blocks:
            if block.field == field:
                rows += (block.rows + at).tolist()
                arrays += block.arrays()
        at += len(part.lines)
    return rows, arrays


def run_table(batches):
    """One pyarrow.Table of claim batches, columns unified (a field lacking is null there)."""
    import pyarrow as pa
    tables = [pa.Table.from_batches([b]) for b in batches]
    if not tables:
        return pa.table({"i": pa.array([], pa.int64()), "ok": pa.array([], pa.bool_()),
                         "error": pa.array([], pa.string())})
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UserError(f"the claims' results do not fit one table ({e}) ---> HINT: read them "
                        f"claim by claim (Run.iter_batches()), or as JSONL")


CLAIM_STATES = ("done", "failed", "dead-lettered", "cancelled", "queued or running", "in no queue",
                "not queued")
ITEM_OUTCOME = {"queued or running": "pending", "in no queue": "pending", "not queued": "pending",
                "dead-lettered": "dead_lettered", "cancelled": "cancelled"}   # claims not run
NOT_RUN = {   # what becomes of the claims of each state that did not run (format_run)
    "queued or running": "still pending; the run goes on",
    "in no queue": "were lost by the pool's queue (removed, recreated or purged): nothing will run them",
    "not queued": "were never sent: nothing will run them",
    "dead-lettered": "were dead-lettered: nothing will run them",
    "cancelled": "were cancelled{why}: nothing will run them",
}


def claim_states(backend, run, summaries, dead_letters=True):
    """{claim: (state, detail)}, state one of CLAIM_STATES (in no queue: its queue lost it), the
    detail the dead-letter or cancel reason. Without dead_letters: no DLQ scan, no queue look."""
    by_claim = {s["claim"]: s for s in summaries}
    cancelled = run.get("cancelled")
    pending = not cancelled and any(claim not in by_claim for claim in run["claims"])
    letters = DeadLetters(backend, run).claims() if pending and dead_letters else {}
    states = {}
    for index, claim in enumerate(run["claims"]):
        s = by_claim.get(claim)
        if s is not None and s["status"] == "cancelled":
            states[claim] = ("cancelled", s["reason"])
        elif s is not None and s.get("error"):
            states[claim] = ("dead-lettered", s["error"])
        elif s is not None:
            states[claim] = ("failed" if s["status"] == "failed" else "done", "")
        elif cancelled:
            states[claim] = ("cancelled", cancelled["reason"])
        elif claim in letters:
            states[claim] = ("dead-lettered", f"{letters[claim]} (its copy in the dead-letter queue; no summary)")
        else:
            states[claim] = ("not queued" if index >= run["sent"] else "queued or running", "")
    waiting = [claim for claim, (state, _) in states.items() if state == "queued or running"]
    if waiting and run["mode"] == "pool" and dead_letters:
        for claim in claims_in_no_queue(backend, run, waiting):
            states[claim] = ("in no queue", "")
    return states


def claims_in_no_queue(backend, run, waiting):
    """The claims of `waiting` that no queue holds (it is gone, newer than the run, purged)."""
    try:
        queue = backend.queues.open_queue(run["queue"])
        depth = queue.counts()
        created = datetime.datetime.fromtimestamp(queue.created_at(), datetime.timezone.utc)
        if depth["visible"] + depth["in_flight"] and created <= _parse_time(run["created_at"], "created_at"):
            return []
    except NotFound:
        pass
    done = summary_claims(backend, run["run_id"])
    return [claim for claim in waiting if claim not in done]


def run_view(backend, run, summaries, dead_letters=True):
    """A report's view of a run: each claim's state, claims per state, items per outcome (they add
    up to the run's items, always) and the queue's depth while claims wait."""
    states = claim_states(backend, run, summaries, dead_letters)
    by_claim = {s["claim"]: s for s in summaries}
    items = dict.fromkeys(("ok", "failed", "pending", "dead_lettered", "cancelled"), 0)
    for index, claim in enumerate(run["claims"]):
        state = states[claim][0]
        if state in ("done", "failed"):
            items["ok"] += by_claim[claim]["ok"]
            items["failed"] += len(by_claim[claim]["failed"])
        else:
            items[ITEM_OUTCOME[state]] += claim_items(run, index)
    counts = Counter(state for state, _ in states.values())
    waiting = {claim: index for index, claim in enumerate(run["claims"]) if states[claim][0] == "queued or running"}
    reported = claims_progress(backend, run["run_id"], waiting) if waiting else {}
    running = sum(min(n, claim_items(run, waiting[claim])) for claim, n in reported.items())
    queue = None
    if counts["queued or running"]:
        with contextlib.suppress(NotFound):
            queue = backend.queues.open_queue(run["queue"]).counts()
    view = {"complete": counts["done"] + counts["failed"] == len(run["claims"]),
            "claims": {claim: {"state": state, "detail": detail} for claim, (state, detail) in states.items()},
            "claim_counts": {state: counts[state] for state in CLAIM_STATES}, "items": items, "queue": queue,
            "items_running_done": running}
    return dict(view, state=run_state(run, view))


RUN_STATES = ("running", "done", "done with failures", "failed", "cancelled", "dead-lettered",
              "interrupted")


def run_state(run, view):
    """The run's one state of RUN_STATES, from its record and run_view's claims and items: the one
    word every view gives a run (runs list, runs show, the dashboard; docs/contract.md)."""
    counts, items = view["claim_counts"], view["items"]
    if counts["cancelled"] or run.get("cancelled"):
        return "cancelled"
    if not run["staged"]:   # submit still cuts claims
        return "running"
    if counts["not queued"] or counts["in no queue"]:   # nothing runs those before runs resume
        return "interrupted"
    if counts["queued or running"]:
        return "running"
    if counts["dead-lettered"]:
        return "dead-lettered"
    if not items["failed"]:
        return "done"
    return "failed" if not items["ok"] else "done with failures"


def claim_list(claims):
    """Claims as short text, consecutive ones as a span: 'c00001, c00003..c00009'."""
    spans = []
    for claim in claims:
        if spans and int(claim[1:]) == int(spans[-1][1][1:]) + 1:
            spans[-1][1] = claim
        else:
            spans.append([claim, claim])
    return ", ".join(first if first == last else f"{first}..{last}" for first, last in spans)


def next_step(run, state):
    """What the user can do about the run's claims in `state`, one that did not run."""
    if state == "queued or running":
        return f"wait, or read it later: {command()} runs show {run['run_id']}"
    if state == "cancelled" or run["mode"] == "cold":   # a cold run's queue is gone once it ends
        return "submit those items again"
    if state == "not queued":
        return f"{command()} runs resume {run['run_id']} (or runs cancel {run['run_id']})"
    if state == "in no queue":
        return (f"{command()} runs resume {run['run_id']} re-sends them (first `pool create` "
                f"again if the pool is gone)")
    return f"{command()} runs redrive {run['run_id']}"


def format_run(run, summaries, view, results_uri, names):
    """The lines `submit` and `runs show` print: items per outcome and the run's state, claims per
    state, the claim table, dead letters, errors (failed items by `names`), the results' place,
    what becomes of claims not run."""
    items, counts, queue = view["items"], view["claim_counts"], view["queue"]
    per_state = [f"{n} {state}" for state, n in counts.items() if n]
    if queue:
        per_state = [p + f" ({run['queue']}: {queue['visible']} visible, {queue['in_flight']} in flight)"
                     if p.endswith("queued or running") else p for p in per_state]
    running = f" ({view['items_running_done']} of them done in running claims)" if view["items_running_done"] else ""
    lines = [f"run {run['run_id']} ({run['mode']}, model {run['model']}): {items['ok']} items ok, "
             f"{items['failed']} failed, {items['pending']} pending{running}, {items['dead_lettered']} "
             f"dead-lettered, {items['cancelled']} cancelled (of {run['items']} items); "
             f"state: {view['state']}",
             "  claims: " + ", ".join(per_state),
             f"  claim sizes: {format_sizes(claim_sizes(run))} ({run.get('sizing') or 'a fixed size'})"
             + (f"; version {run['version']}" if run.get("version") else ""),
             f"  {'claim':<8} {'worker':<28} {'warm':<5} {'enter_s':>8} {'ok':>6} {'failed':>6} {'seconds':>8}  status"]
    by_claim, claims, index = {s["claim"]: s for s in summaries}, run["claims"], 0
    while index < len(claims):
        state = view["claims"][claims[index]]["state"]
        if state in ("done", "failed"):
            s = by_claim[claims[index]]
            lines.append(f"  {s['claim']:<8} {s['worker_id'][:28]:<28} {'yes' if s['warm_hit'] else 'no':<5} "
                         f"{s['enter_seconds_paid']:>8.3f} {s['ok']:>6} {len(s['failed']):>6} "
                         f"{s['claim_seconds']:>8.3f}  {s['status']}")
            index += 1
            continue
        last = index
        while last + 1 < len(claims) and view["claims"][claims[last + 1]]["state"] == state:
            last += 1
        span = f" (through {claims[last]}: {last - index + 1} claims)" if last > index else ""
        lines.append(f"  {claims[index]:<8} {'-':<28} {'-':<5} {'-':>8} {'-':>6} {'-':>6} {'-':>8}  {state}{span}")
        index = last + 1
    lines += [f"  claim {claim} dead-lettered: {v['detail']}" for claim, v in view["claims"].items()
              if v["state"] == "dead-lettered"]
    lines += format_item_errors(run, summaries, names)
    lines.append(f"  results: {results_uri}  ({command()} runs results {run['run_id']})")
    cancelled = sorted({v["detail"] for v in view["claims"].values() if v["state"] == "cancelled"})
    why = f" ({'; '.join(cancelled)})"
    for state, what in NOT_RUN.items():
        if counts[state]:
            lines.append(f"  not finished: {counts[state]} claim(s) {what.format(why=why)} ---> "
                         f"HINT: {next_step(run, state)}")
    return lines


def item_errors(summaries):
    """[(message, [item indices])] of the failed items' kept messages, one group per distinct
    message (its count exact), the most frequent first."""
    groups = {}
    for s in summaries:
        for index, message in s.get("errors", {}).items():
            groups.setdefault(message, []).append(int(index))
    return sorted(groups.items(), key=lambda g: (-len(g[1]), min(g[1])))


def first_items(groups, count):
    """Indices of the items a report names: the first few of each of its first `count` groups."""
    return [i for _, indices in groups[:count] for i in sorted(indices)[:FIRST_ITEMS_SHOWN]]


def item_names(backend, run, summaries, indices):
    """{index: name} of these failed items: their --id-field value, else a file's path (one read of
    the manifest of each claim holding some), else their index."""
    claim_of = {int(i): s["claim"] for s in summaries for i in s.get("errors", {})}
    wanted, names = collections.defaultdict(list), dict(zip(indices, indices))
    for i in indices:
        wanted[claim_of[i]].append(i)
    for claim, items in wanted.items():
        with contextlib.suppress(NotFound):   # a manifest deleted: its items keep their indices
            manifest = json.loads(backend.store.get(manifest_key(run["run_id"], claim)))
            field = run["options"].get("id_field")
            ids = (claim_ids(backend, run, claim, field, manifest) if field else
                   [name for name, _, _ in manifest["refs"]["objects"]] if "refs" in manifest else
                   [item.get("path") if isinstance(item, dict) else None
                    for item in manifest["items"]] if "bytes" in manifest else [])   # a copied file
            for i in items:
                k = i - manifest["first_index"]
                if k < len(ids) and ids[k] is not None:
                    names[i] = ids[k]
    return names


def format_item_errors(run, summaries, names):
    """The report's failed items by error: count, message, its first items (by `names`)."""
    failed = sum(len(s["failed"]) for s in summaries)
    if not failed:
        return []
    groups = item_errors(summaries)
    lines = [f"  failed items by error ({failed} failed):"]
    for message, indices in groups[:ERROR_GROUPS_SHOWN]:
        first = ", ".join(str(names.get(i, i)) for i in sorted(indices)[:FIRST_ITEMS_SHOWN]) + (
            ", ..." if len(indices) > FIRST_ITEMS_SHOWN else "")
        lines.append(f"    {len(indices):>6} x {message}  (items {first})")
    if len(groups) > ERROR_GROUPS_SHOWN:
        lines.append(f"    (+{len(groups) - ERROR_GROUPS_SHOWN} more errors: --json lists every kept message)")
    unkept = failed - sum(len(indices) for _, indices in groups)
    if unkept:
        lines.append(f"    (+{unkept} failed items whose messages were not kept: {ERRORS_KEPT} are kept per claim)")
    lines.append(f"    their tracebacks: {command()} runs results {run['run_id']} --failed")
    return lines


def listed_run(backend, run):
    """`runs list`'s record of a run: its record with its state and its items ok and failed (its
    summaries read; no dead-letter scan, as the dashboard's)."""
    view = run_view(backend, run, read_summaries(backend, run["run_id"]), dead_letters=False)
    return dict(run, state=view["state"], ok=view["items"]["ok"], failed=view["items"]["failed"])


def format_runs_list(runs, model=None):
    """`runs list`: a header line, then a line a run (listed_run's), oldest first."""
    if not runs:
        return ["no runs" + (f" of model {model}" if model else "") + " in this store"]
    run_w, model_w = (max(len(field), *(len(r[field]) for r in runs)) for field in ("run_id", "model"))
    state_w = max(len(r["state"]) for r in runs)
    return [f"{'run':<{run_w}}  {'mode':<5} {'model':<{model_w}} {'items':>9} {'claims':>7} "
            f"{'ok':>9} {'failed':>9}  {'state':<{state_w}}  created"] + [
        f"{r['run_id']:<{run_w}}  {r['mode']:<5} {r['model']:<{model_w}} {r['items']:>9,} "
        f"{len(r['claims']):>7,} {r['ok']:>9,} {r['failed']:>9,}  {r['state']:<{state_w}}  "
        f"{r['created_at']}" for r in runs]


def report_run(backend, run, summaries, as_json, out=sys.stdout):
    """Print the run (format_run, or JSON); exit code 0 when every item of every claim ran ok."""
    view = run_view(backend, run, summaries)
    if as_json:
        print(json.dumps({"run": run, "summaries": summaries, **view}, indent=1), file=out)
    else:
        shown = first_items(item_errors(summaries), ERROR_GROUPS_SHOWN)
        results = backend.store.uri(f"runs/{run['run_id']}/results/")
        names = item_names(backend, run, summaries, shown)
        print("\n".join(format_run(run, summaries, view, results, names)), file=out)
    all_ok = all(s["status"] == "ok" and not s["failed"] for s in summaries)
    return EXIT_OK if view["complete"] and all_ok else EXIT_FAILED


