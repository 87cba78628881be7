"""Sources: where a run's items come from. Each input kind (a JSONL file or stdin, Python items,
numeric arrays, Arrow tables, files) is one Source class: it counts or streams its items, cuts
them into claims and stages each claim's manifest. read_claim reads any claim back for a worker;
the results and redrive read it through manifest_items and claim_field (docs/contract.md,
"Sources"). Stands on calque_core; calque_runs sends what a source stages."""
import collections, contextlib, glob, itertools, json, os, re, stat, sys, threading, zipfile
import zlib

from calque_core import (CLAIM_BYTES, Changed, ITEM_BYTES_MAX, ITEM_DEPTH_MAX, LocalStore,
                         NotFound, READ_BLOCK, READ_FIRST, Requests, S3Store, Unavailable,
                         UserError, _aws_error_info, aws_error_line, checked_json, did_you_mean,
                         dumps, json_line, npy_bytes, npy_view, size_text, text_lines, to_jsonable,
                         unchanged)

RESULT_FIELDS = ("i", "ok", "result", "error", "trace")   # a result line's own: never an --id-field
FETCH_AHEAD_ITEMS = 256         # objects by reference fetched ahead of the item read, at most ...
FETCH_AHEAD_BYTES = 256 << 20   # ... and their bytes, at most (one object at least)


class Source:
    """Items of one input kind. Every kind implements
        claims(sizes)                    (start, stop, chunk, media bytes) of each claim, cut by
                                         a ClaimSizes: what stage receives as `chunk`
        stage(backend, manifest, chunk)  the claim's manifest text, what it holds beside written
    and overrides what follows where it differs. A manifest's forms are read back by
    manifest_items and read_claim, whatever kind wrote them."""
    where = "the items"   # what an error names
    count = None          # items, or None: a stream, counted as it is cut
    fields = None         # the fields every item has (--id-field), or None: each item says
    noun = "column"       # what such a field is called
    large = False         # read in large blocks: submit keeps few malloc arenas
    reads = None          # an s3:// prefix the workers read in place (an EC2 role is granted it)

    def place(self, backend, record):
        """Decide how claims are staged on `backend`: by reference where its workers can read
        the source, else copied (docs/contract.md, "Media")."""

    def counted(self):
        """This source, its count known (a stream read in); None for a listing (read twice)."""
        return self

    def head(self, n):
        """The first `n` items, as a source: a plan's sample claim (JSONL and Python items)."""
        raise UserError(f"{self.where}: a plan's sample claim takes JSONL or Python items ---> "
                        f"HINT: run a first claim on the pool (submit without --plan), then plan")

    def with_id_field(self, field):
        """This source, every item of which has `field` (--id-field), none of a result line's own:
        checked now where the kind names its fields, else as each item is read (each_with)."""
        if field in RESULT_FIELDS:
            raise UserError(f"--id-field {field!r} is a result line's own field ---> HINT: name "
                            f"another item field")
        if self.fields is None:
            return self.each_with(field)
        if field not in self.fields:
            raise UserError(f"--id-field {field!r}: no {self.noun} of that name "
                            f"({', '.join(self.fields)})")
        return self


def as_items(items, columns=None):
    """The Source of what a user holds: a path (read_items), a table, arrays, a Source, a list, or
    any iterable (staged as it yields, a claim at a time)."""
    if isinstance(items, (str, os.PathLike)):
        return read_items(os.fspath(items), columns)
    if type(items).__module__.split(".")[0] in ("pyarrow", "pandas", "datasets"):
        return TableItems.open(items, columns)
    if columns:
        raise UserError("columns= applies to a path of Parquet or Arrow input, or a table")
    if isinstance(items, Source):
        return items
    if hasattr(items, "dtype") and hasattr(items, "shape"):
        return ArrayItems.from_arrays({"input": items}, "the array")
    if isinstance(items, dict):
        return ArrayItems.from_arrays(items, "the arrays")
    return Items(items)


def read_items(path, columns=None):
    """The Source of a path: a JSONL file ('-': stdin; JsonLines), read as staged but its first
    block at once (a bad line there is refused first). A .npy or .npz file is numeric (ArrayItems);
    a Parquet or Arrow file, folder or glob is a table (TableItems) of which `columns` are read; a
    folder or glob of other files, or an s3:// prefix or glob, is one item a file (FileItems)."""
    if path.endswith((".npy", ".npz")):
        return ArrayItems.from_arrays(read_arrays(path), path)
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
    return JsonLines(itertools.chain(next(blocks), itertools.chain.from_iterable(blocks)), path)


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


def checked_line(line, path, lineno):
    """One JSONL line, checked and trimmed, or a UserError naming path:lineno (submit refuses a bad
    line, no worker dead-letters it). An item nested deeper than ITEM_DEPTH_MAX is refused too: its
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
    return line.strip(" \t\r")   # JSON's whitespace (a valid line has no other)


def json_depth(value):
    """Levels of nested arrays and objects in a parsed JSON value, walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            todo += [(c, depth + 1) for c in (node.values() if isinstance(node, dict) else node)]
    return deepest


class Items(Source):
    """Python items: a list (counted) or any iterable, read as claims are cut (a Lookahead).
    Staged as JSON in the manifest, in the bytes form where an item holds bytes (stage_bytes)."""
    lines = False   # items as JSONL text (JsonLines)

    def __init__(self, items, where="the items"):
        self.items, self.where = items, where
        self.count = len(items) if isinstance(items, list) else None
        if self.count == 0:
            raise UserError("no items to submit")

    def counted(self):
        return self if self.count is not None else type(self)(list(self.items), self.where)

    def head(self, n):
        """The first `n` items (of a counted source), as a source: a plan's sample claim."""
        return type(self)(self.items[:n], self.where)

    def claims(self, sizes):
        """Claims of the sizes asked, fewer items where their bytes values pass CLAIM_BYTES."""
        start, it = 0, iter(self.items) if self.count else Lookahead(self.items, sizes.ahead())
        left = (lambda: self.count - start) if self.count else it.left
        while chunk := list(itertools.islice(it, sizes.next(left()))):
            yield from self.cut(start, chunk)
            start += len(chunk)

    def cut(self, start, chunk):
        """The claims of a chunk of items from `start`: one, or more where they hold bytes."""
        return _cut(start, chunk, list(map(_media_size, chunk)))

    def stage(self, backend, manifest, chunk):
        try:
            return json.dumps(dict(manifest, items=chunk), default=_no_bytes, separators=(",", ":"))
        except HoldsBytes:
            return dumps(dict(manifest, **stage_bytes(backend, manifest, chunk)))

    def each_with(self, field):
        checked = map(self._has_field, itertools.repeat(field), itertools.count(), self.items)
        return type(self)(checked if self.count is None else list(checked), self.where)

    def _has_field(self, field, index, item):
        value = json_line(item) if self.lines else item
        if not isinstance(value, dict) or field not in value:
            raise UserError(f"--id-field {field!r}: item {index} has no such field ---> HINT: "
                            "give every item one, or drop --id-field")
        return item


class JsonLines(Items):
    """Items as their JSONL lines (checked_line): the manifest joins the lines as they are, no
    line parsed again (--id-field's check parses each once)."""
    lines = True

    def cut(self, start, chunk):
        return [(start, start + len(chunk), chunk, 0)]   # JSON text holds no bytes

    def stage(self, backend, manifest, chunk):
        return f'{dumps(manifest)[:-1]},"items":[{",".join(chunk)}]}}'


class HoldsBytes(Exception):
    """A Python item holds bytes: its claim is staged in the bytes form (stage_bytes)."""


def _no_bytes(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise HoldsBytes
    return to_jsonable(value)


class ArrayItems(Source):
    """Numeric items from a .npy file (item i = {"input": a[i]}) or a .npz file, array `k` [N, ...]
    the field k of every item; `k_offsets` (N+1 indices) makes `k` ragged. Staged as .npy objects
    per claim and field, which the worker maps as views: no per-item parsing, no pickle."""
    noun = "array"

    def __init__(self, arrays, count, where):
        self.arrays, self.count, self.where = arrays, count, where   # name -> (values, offsets)
        self.fields = list(arrays)

    def claims(self, sizes):
        """(start, stop, None, 0) of each claim: the arrays are sliced when staged."""
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
            if offsets is not None and (values.ndim != 1 or offsets.ndim != 1 or len(offsets) < 1
                                        or offsets.dtype.kind not in "iu" or offsets[0] != 0
                                        or offsets[-1] != len(values)
                                        or (np.diff(offsets) < 0).any()):
                raise UserError(f"{path}: {name}_offsets must be N+1 increasing ints from 0 to "
                                f"len({name}) over a 1-D {name}")
            if values.ndim == 0:
                raise UserError(f"{path}: array {name!r} is a scalar: its first axis must index "
                                f"the items")
            counts[name] = len(values) if offsets is None else len(offsets) - 1
            fields[name] = (np.ascontiguousarray(values), offsets)
        if len(set(counts.values())) > 1:
            raise UserError(f"{path}: fields disagree on the item count: {counts}")
        count = next(iter(counts.values()), 0)
        if count == 0:
            raise UserError(f"{path} holds no items")
        return cls(fields, count, path)

    def stage(self, backend, manifest, chunk):
        """Write this claim's slice of every field as .npy; the manifest's `arrays`."""
        fields, start = {}, manifest["first_index"]
        stop = start + manifest["count"]
        for name, (values, offsets) in self.arrays.items():
            if offsets is None:
                fields[name] = {"values": values[start:stop]}
            else:
                fields[name] = {"values": values[offsets[start]:offsets[stop]],
                                "offsets": offsets[start:stop + 1] - offsets[start]}
        return dumps(dict(manifest, arrays=stage_arrays(backend, manifest, fields)))


def stage_arrays(backend, manifest, fields):
    """Write each field's {role: array} (values, offsets, valid) as .npy objects; returns the
    manifest's `arrays` ({field: {role: key}}), keys numbered (a column name need not be safe)."""
    entry = {}
    for number, (name, roles) in enumerate(fields.items()):
        entry[name] = {}
        for role, array in roles.items():
            key = f"runs/{manifest['run_id']}/inputs/{manifest['claim']}/{number}.{role}.npy"
            backend.store.put(key, npy_bytes(array))
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


class TableItems(Source):
    """Items from Arrow tables, one a row ({column: value}): Parquet (a file, folder or glob), Arrow
    IPC, or a pyarrow.Table, pandas DataFrame or datasets.Dataset, streamed a claim at a time.
    Numeric columns (and lists of numbers) are staged as .npy (a null: None); others go as JSON in
    the manifest, dates and times as ISO text, binary values (an HF Image's struct<bytes, path>)
    as bytes (stage_bytes); a type JSON cannot hold is refused up front. A Parquet path with binary
    columns is staged by reference (row ranges) where place says the workers can read it."""
    large = True

    def __init__(self, schema, count, batches, where, files=None):
        import pyarrow as pa
        self.count, self.batches, self.where, self.files = count, batches, where, files
        self.numeric, self.json, self.binary = [], [], []
        for field in schema:
            kind = _column_kind(pa, field.type)
            if kind is None:
                raise UserError(f"{where}: column {field.name!r} is {field.type}, which has no JSON "
                                f"form ---> HINT: leave it out with --columns, or cast it (to "
                                f"string) before submitting")
            (self.numeric if kind == "numeric" else self.json).append(field.name)
            if _holds_binary(pa, field.type):
                self.binary.append(field.name)
        self.fields, self.media, self.by_reference = schema.names, bool(self.binary), False
        if not count:
            raise UserError(f"{where} holds no items")

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

    def place(self, backend, record):
        """A Parquet path of media by reference where the workers read this machine's files."""
        self.by_reference = bool(self.media and self.files and backend.kind == "local")
        if self.media and self.files and not self.by_reference:
            print(f"calque: {self.where}: its media are copied into the store: the workers of "
                  f"{backend.describe()} cannot read this machine's files", file=sys.stderr)

    def claims(self, claim_sizes):
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
            raise _too_large(f"{self.where}: row {first + int(over[0])}", int(sizes[over[0]]))
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

    def stage(self, backend, manifest, table):
        """A claim's manifest: JSON columns as `items` (their bytes beside: `bytes`), numeric ones
        as `arrays`; by reference, its row ranges (`rows`)."""
        import pyarrow as pa
        if self.by_reference:
            return dumps(dict(manifest, rows={"columns": self.fields, "files": table}))
        start = manifest["first_index"]
        fields = {name: _numeric_column(table.column(name).combine_chunks(), name, start,
                                        self.where) for name in self.numeric}
        staged = dict(manifest, **{"arrays": stage_arrays(backend, manifest, fields)} if fields
                      else {})
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
            staged.update(stage_bytes(backend, manifest, items, blob) if self.media else
                          {"items": items})
        return dumps(staged)


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
    totals = enumerate(itertools.accumulate(sizes))
    return next((k for k, total in totals if total > CLAIM_BYTES and k), len(sizes))


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


def stage_bytes(backend, manifest, items, blob=None):
    """A claim's items in the bytes form: every bytes value (at any depth of dicts and lists) is
    None in `items` and staged in one object beside the manifest, `at` saying where each goes;
    returns those manifest fields. Never JSON text, never base64, never pickle."""
    blob = blob or Blob()
    items = [_take_bytes(item, k, [], blob) for k, item in enumerate(items)]
    key = f"runs/{manifest['run_id']}/inputs/{manifest['claim']}/bytes"
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


class FileItems(Items):
    """One item a file, {"path": its path under the folder, glob root or prefix given, "bytes": its
    content}: a local folder or glob, or an s3:// prefix or glob, listed as a stream in path order
    (a prefix of a million objects: claims go out while the listing goes on), hidden files and
    folders skipped. By reference (`refs`) where the workers can read the source, else copied
    (`bytes`, CLAIM_BYTES a claim): place decides."""
    media, by_reference, large, fields, count = True, True, True, ["path"], None

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

    @property
    def reads(self):
        return self.uri() if self.bucket is not None else None

    def counted(self):
        return None   # a listing is read as it is staged: counting it first would list it twice

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

    @property
    def items(self):   # the listing, read as claims are cut (Items.claims)
        return self.entries()

    def cut(self, start, chunk):
        """Cut at CLAIM_BYTES where copied (not by reference); a file over ITEM_BYTES_MAX refused."""
        for name, n, _ in chunk:
            if n > ITEM_BYTES_MAX:
                raise _too_large(f"{self.where}: {name}", n)
        return _cut(start, chunk, [0 if self.by_reference else n for _, n, _ in chunk])

    def stage(self, backend, manifest, chunk):
        """By reference: `refs`, the objects named with their size and version; else their bytes."""
        if self.by_reference:
            objects = [list(e) for e in chunk]
            return dumps(dict(manifest, refs={"source": self.uri(), "objects": objects}))
        items = []
        for name, _, _ in chunk:
            try:
                items.append({"path": name, "bytes": self.source.get(name)})
            except NotFound:
                raise UserError(f"{self.where}: {name} vanished while submit read it") from None
        return dumps(dict(manifest, **stage_bytes(backend, manifest, items)))

    def place(self, backend, record):
        """By reference where the workers read the source: a local folder with the local store, an
        s3:// prefix with an s3:// store (one elsewhere is refused); else copied, said in a line."""
        if self.bucket is None:
            self.by_reference = backend.kind == "local"
            if not self.by_reference:
                print(f"calque: {self.where}: its files are copied into the store: the workers "
                      f"of {backend.describe()} cannot read this machine's folder ---> HINT: upload "
                      f"it (aws s3 sync) and submit its s3:// prefix to have it read where it is",
                      file=sys.stderr)
            return
        if backend.kind != "aws":
            raise UserError(f"{self.where}: an s3:// input needs an s3:// store, whose workers read "
                            f"it where it is ---> HINT: CALQUE_STORE=s3://bucket/prefix, or copy the "
                            f"files here and submit the folder")
        inside = backend.store.uri("")
        if self.uri().startswith(inside) or inside.startswith(self.uri()):
            raise UserError(f"{self.where}: it overlaps the calque store {backend.describe()}: a run "
                            f"reads no other run's objects ---> HINT: keep inputs under another prefix")
        self.source = S3Store(backend.store.s3, self.bucket, self.root, backend.requests,
                              backend.store.endpoint_retry)


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
    sizes = [f.metadata.row_group(g).num_rows for g in range(f.metadata.num_row_groups)]
    starts = [0, *itertools.accumulate(sizes)]   # the first row of each group
    groups = [g for g, n in enumerate(sizes) if starts[g] < stop and starts[g] + n > start]
    batches, skip, want = [], start - starts[groups[0] if groups else 0], stop - start
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
    return merge_fields(items, {name: _numeric_column(table.column(name).combine_chunks(), name,
                                                      start, source) for name in numeric})


# ---- reading a claim back: a worker runs it, results name its items (whatever kind staged it)
def array_items(store, manifest):
    """A numeric claim's items: [{field: view into the fetched bytes}], merged into the manifest's
    JSON `items` when it has both; None where `valid` is False."""
    fields, count = {}, manifest["count"]
    for name, keys in manifest["arrays"].items():
        values, offsets, valid = (npy_view(store.get(keys[role])) if role in keys else None
                                  for role in ("values", "offsets", "valid"))
        if (offsets is not None and len(offsets) != count + 1) or (offsets is None and len(values) != count) \
                or (valid is not None and len(valid) != count):
            raise ValueError(f"field {name!r} does not hold {count} items")
        fields[name] = {"values": values, "offsets": offsets, "valid": valid}
    items = manifest.get("items") or [{} for _ in range(count)]
    if len(items) != count:
        raise ValueError(f"'items' does not hold {count} items")
    return merge_fields(items, fields)


def merge_fields(items, fields):
    """Set each {field: {role: array}} (_numeric_column's roles) in the items, row i item i's."""
    for name, roles in fields.items():
        values, offsets, valid = roles["values"], roles.get("offsets"), roles.get("valid")
        for i, item in enumerate(items):
            item[name] = (None if valid is not None and not valid[i] else
                          values[i] if offsets is None else values[offsets[i]:offsets[i + 1]])
    return items


def bytes_items(store, manifest, items):
    """Set a manifest's `bytes` in its items: each [k, path, start, stop] of `at` is the slice of
    the object `key` found at `path` (dict keys, list indices) in item k; an empty path: item k."""
    entry = manifest["bytes"]
    blob = store.get(entry["key"])
    for k, path, start, stop in entry["at"]:
        if not 0 <= start <= stop <= len(blob):
            raise ValueError(f"bytes [{start}, {stop}) are outside {entry['key']}")
        node, *steps, last = [items, k, *path]
        for step in steps:
            node = node[step]
        node[last] = blob[start:stop]
    return items


def manifest_items(store, manifest):
    """A claim's items as its manifest holds them: JSON `items`, numeric `arrays` merged in, `bytes`
    set in (the by-reference forms, `refs` and `rows`: read_claim)."""
    items = array_items(store, manifest) if "arrays" in manifest else manifest["items"]
    if not isinstance(items, list):
        raise ValueError("'items' is not a list")
    return bytes_items(store, manifest, items) if "bytes" in manifest else items


def read_claim(backend, manifest, fetchers):
    """A claim's items as a worker runs them (docs/contract.md, "Media"): as its manifest holds
    them (Held), a Parquet file's row range read now, or objects by reference fetched ahead on
    `fetchers` (FetchedItems). A source these workers cannot read (a local one with an s3://
    store, a path outside it) is a ValueError."""
    local = backend.kind == "local"
    if "rows" in manifest:
        if not local:
            raise ValueError("a Parquet row range by reference needs the local store")
        return Held(rows_items(manifest["rows"]))
    if "refs" not in manifest:
        return Held(manifest_items(backend.store, manifest))
    source, objects = manifest["refs"]["source"], manifest["refs"]["objects"]
    for name, size, _ in objects:
        if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/") or size < 0:
            raise ValueError(f"refs object {name!r} of size {size!r} refused")
    if local and source.startswith("file:///"):
        store = LocalStore(source[len("file://"):], backend.requests)
    elif not local and source.startswith("s3://"):
        bucket, _, prefix = source[len("s3://"):].partition("/")
        mine = backend.store
        store = S3Store(mine.s3, bucket, prefix.strip("/"), backend.requests, mine.endpoint_retry)
    else:
        raise ValueError(f"refs source {source!r} cannot be read by the workers of "
                         f"{backend.describe()}")
    return FetchedItems(store, objects, fetchers, backend.requests.carried(store.fetch))


def claim_field(store, manifest, field):
    """The `field` of each of a claim's items, read from its manifest (by reference: a file's
    path, a Parquet column's values, nothing fetched); a bytes value or none reads as null."""
    if "refs" in manifest:
        return [name for name, _, _ in manifest["refs"]["objects"]]
    items = (rows_items(dict(manifest["rows"], columns=[field])) if "rows" in manifest else
             array_items(store, manifest) if "arrays" in manifest else manifest["items"])
    values = [item.get(field) if isinstance(item, dict) else None for item in items]   # else: Unavailable
    return [getattr(v, "tolist", lambda v=v: v)() for v in values]   # numpy values as plain ones


class Held(list):
    """A claim's items held whole (its manifest's): nothing to fetch ahead, drop or close."""
    fetched = False

    def drop(self, offsets=()):
        """Nothing to forget (nor, as close, to cancel)."""

    close = drop


class FetchedItems:
    """A claim's items by reference (a manifest's `refs`): item k is {"path": its name, "bytes": the
    object}, fetched on the fetch threads in order, ahead of the batch that reads it (FETCH_AHEAD_ITEMS
    and FETCH_AHEAD_BYTES at most, one at least), dropped once its batch has run. An object that
    changed or vanished since submit is an Unavailable naming it, so that its item fails alone; a
    store fault past the store's retries is raised to the thread that reads it (the claim is let go)."""
    fetched = True   # each item waits on its fetch: never scanned ahead, the wait not model time

    def __init__(self, source, objects, pool, fetch):
        self.source, self.objects, self.pool, self.fetch = source, objects, pool, fetch
        self.futures, self.next, self.held = {}, 0, 0   # offset -> future; next to fetch; bytes held
        self.lock = threading.Lock()

    def __len__(self):
        return len(self.objects)

    def __getitem__(self, k):
        if not 0 <= k < len(self.objects):
            raise IndexError(k)
        with self.lock:
            if k not in self.futures:     # the first read (a resumed claim: from its start), or again
                self._fetch_ahead(k)
                self.next = max(self.next, k + 1)
            while (self.next < len(self.objects) and self.next - k < FETCH_AHEAD_ITEMS
                   and self.held < FETCH_AHEAD_BYTES):
                self._fetch_ahead(self.next)
                self.next += 1
            future = self.futures[k]
        value = future.result()
        return value if type(value) is Unavailable else {"path": self.objects[k][0], "bytes": value}

    def _fetch_ahead(self, k):
        self.futures[k] = self.pool.submit(self._get, k)
        self.held += self.objects[k][1]

    def _get(self, k):
        name, size, version = self.objects[k]
        try:
            return self.fetch(name, size, version)
        except NotFound:
            return Unavailable(f"{self.source.uri(name)}: vanished since submit")
        except Changed as e:
            return Unavailable(f"{self.source.uri(name)}: changed since submit ({e})")

    def drop(self, offsets):
        """Forget these items' bytes: their batch has run."""
        with self.lock:
            for k in offsets:
                if self.futures.pop(k, None) is not None:
                    self.held -= self.objects[k][1]

    def close(self):
        with self.lock:
            for future in self.futures.values():
                future.cancel()
            self.futures.clear()


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

