/* The OTLP byte reader of collectors/otlp_wire.py, compiled.
 *
 * The same walk of the same wire format, field for field and check for check, with the same
 * answer for every body: the spans' parts, or Unusual (the caller then parses the body with upb).
 * otlp_wire.py is the reference; this file mirrors its functions one to one, under their names
 * less the underscore (_tag is tag_at), so a change to one is made to the other
 * (tests/test_otlp_wire.py runs every case on both; tests/test_otlp_wire_compiled.py compares
 * their answers byte for byte on mutated bodies and random bytes).
 *
 * Two things are left to Python, through callables given to configure(): cutting long texts, and
 * the hex of a bytes value. The key-value cache is a dict of the caller's, as in otlp_wire.py.
 *
 * Every read is bounded by the buffer it reads from, as Python's indexing is (an IndexError there
 * is Unusual here); no value read from the body is trusted as a length before it is checked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *data;
    Py_ssize_t len;
} Buf;

/* Set by configure(). */
static PyObject *Unusual;      /* the exception class */
static PyObject *cut_fn;       /* cut_text(text, limit) */
static PyObject *hex_fn;       /* a bytes value's text, cut */
static PyObject *kv_cache;     /* dict: a key-value's bytes -> (key, value) */
static Py_ssize_t max_attributes, max_string_chars, max_array_items, max_depth, max_key_chars;
static Py_ssize_t kv_cache_max, kv_cache_bytes;
/* Field numbers each message defines, one bit each (all are below 64). */
static uint64_t known_request, known_resource_spans, known_resource, known_scope_spans, known_span,
    known_status, known_any_value, known_key_value, known_scope, known_event, known_link;
static const uint64_t known_first = 1u << 1; /* arrays' and key-value lists' one field */

static int
unusual(const char *why)
{
    PyErr_SetString(Unusual, why);
    return -1;
}

static int
is_known(uint64_t known, uint64_t field)
{
    return field < 64 && ((known >> field) & 1);
}

/* A varint at *pos. A value past 64 bits (a tenth byte above 1) sets *over: as a length it is
 * too long for any body, as a tag it names no field this reader knows; masked values (kinds,
 * status codes, ints, bools) keep their low bits either way. */
static int
varint(const Buf *b, Py_ssize_t *pos, uint64_t *out, int *over)
{
    uint64_t result = 0;
    int shift = 0;
    *over = 0;
    for (;;) {
        if (*pos >= b->len)
            return unusual("varint runs past the body");
        unsigned byte = b->data[(*pos)++];
        uint64_t part = byte & 0x7F;
        result |= part << shift;
        if (shift == 63 && part > 1)
            *over = 1;
        if (byte < 0x80) {
            *out = result;
            return 0;
        }
        shift += 7;
        if (shift > 63)
            return unusual("varint longer than 10 bytes");
    }
}

/* A tag; one past 64 bits becomes a tag of the same wire type and an unknown field. */
static int
tag_at(const Buf *b, Py_ssize_t *pos, uint64_t *tag)
{
    int over;
    if (*pos >= b->len)
        return unusual("tag runs past the body");
    if (b->data[*pos] < 0x80) {
        *tag = b->data[(*pos)++];
        return 0;
    }
    if (varint(b, pos, tag, &over) < 0)
        return -1;
    if (over)
        *tag = (*tag & 7) | ((uint64_t)1 << 62);
    return 0;
}

/* A length-delimited field's [start, end), checked to lie inside stop. */
static int
length(const Buf *b, Py_ssize_t *pos, Py_ssize_t stop, Py_ssize_t *start, Py_ssize_t *end)
{
    uint64_t size;
    int over = 0;
    if (*pos >= b->len)
        return unusual("length runs past the body");
    size = b->data[*pos];
    if (size < 0x80)
        (*pos)++;
    else if (varint(b, pos, &size, &over) < 0)
        return -1;
    if (over || *pos > stop || size > (uint64_t)(stop - *pos))
        return unusual("field runs past its message");
    *start = *pos;
    *end = *pos + (Py_ssize_t)size;
    *pos = *end;
    return 0;
}

static int
skip(const Buf *b, Py_ssize_t *pos, Py_ssize_t stop, uint64_t tag, uint64_t known)
{
    uint64_t field = tag >> 3, value;
    Py_ssize_t start, end;
    int over;
    if (field == 0 || is_known(known, field))
        return unusual("a known field with a wire type this reader does not take");
    switch (tag & 7) {
    case 0:
        if (varint(b, pos, &value, &over) < 0)
            return -1;
        break;
    case 1:
        *pos += 8;
        break;
    case 2:
        if (length(b, pos, stop, &start, &end) < 0)
            return -1;
        break;
    case 5:
        *pos += 4;
        break;
    default:
        return unusual("wire type");
    }
    if (*pos > stop)
        return unusual("field runs past its message");
    return 0;
}

static PyObject *
text(const Buf *b, Py_ssize_t start, Py_ssize_t end)
{
    PyObject *out = PyUnicode_DecodeUTF8((const char *)b->data + start, end - start, NULL);
    if (out == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        unusual("invalid UTF-8");
    }
    return out;
}

static int
valid_text(const Buf *b, Py_ssize_t start, Py_ssize_t end)
{
    PyObject *out = text(b, start, end);
    if (out == NULL)
        return -1;
    Py_DECREF(out);
    return 0;
}

static PyObject *
cut(PyObject *value, Py_ssize_t limit)
{
    PyObject *out = PyObject_CallFunction(cut_fn, "On", value, limit);
    Py_DECREF(value);
    return out;
}

static uint64_t
le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* -- attributes -------------------------------------------------------------------------------- */
static PyObject *any_value(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, Py_ssize_t depth);

/* A key-value's key (cut) and where its value lies; *has_value 0 when it has none. */
static PyObject *
kv_parts(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, int *has_value, Py_ssize_t *vstart, Py_ssize_t *vend)
{
    PyObject *key = NULL;
    uint64_t tag;
    Py_ssize_t start, end;
    *has_value = 0;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            goto fail;
        if (tag == 0x0A) {
            if (length(b, &pos, stop, &start, &end) < 0)
                goto fail;
            Py_XDECREF(key);
            if ((key = text(b, start, end)) == NULL)
                goto fail;
        }
        else if (tag == 0x12) {
            if (*has_value) {
                unusual("a key-value with two values");
                goto fail;
            }
            if (length(b, &pos, stop, vstart, vend) < 0)
                goto fail;
            *has_value = 1;
        }
        else if (skip(b, &pos, stop, tag, known_key_value) < 0)
            goto fail;
    }
    if (pos > stop) {
        unusual("field runs past its key-value");
        goto fail;
    }
    if (key == NULL)
        return PyUnicode_FromStringAndSize("", 0);
    if (PyUnicode_GET_LENGTH(key) > max_key_chars)
        return cut(key, max_key_chars);
    return key;
fail:
    Py_XDECREF(key);
    return NULL;
}

static PyObject *
array(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, Py_ssize_t depth)
{
    PyObject *items = PyList_New(0), *item;
    uint64_t tag;
    Py_ssize_t start, end;
    if (items == NULL)
        return NULL;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            goto fail;
        if (tag == 0x0A) {
            if (length(b, &pos, stop, &start, &end) < 0)
                goto fail;
            if (PyList_GET_SIZE(items) == max_array_items) {
                unusual("more array items than are kept");
                goto fail;
            }
            if ((item = any_value(b, start, end, depth)) == NULL)
                goto fail;
            int failed = PyList_Append(items, item);
            Py_DECREF(item);
            if (failed)
                goto fail;
        }
        else if (skip(b, &pos, stop, tag, known_first) < 0)
            goto fail;
    }
    if (pos > stop) {
        unusual("field runs past its array");
        goto fail;
    }
    return items;
fail:
    Py_DECREF(items);
    return NULL;
}

static PyObject *
kvlist(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, Py_ssize_t depth)
{
    PyObject *out = PyDict_New(), *key, *value;
    uint64_t tag;
    Py_ssize_t start, end, vstart = 0, vend = 0, count = 0;
    int has_value;
    if (out == NULL)
        return NULL;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            goto fail;
        if (tag == 0x0A) {
            if (length(b, &pos, stop, &start, &end) < 0)
                goto fail;
            if (++count > max_array_items) {
                unusual("more key-values than are kept");
                goto fail;
            }
            if ((key = kv_parts(b, start, end, &has_value, &vstart, &vend)) == NULL)
                goto fail;
            if (has_value)
                value = any_value(b, vstart, vend, depth);
            else
                value = Py_NewRef(Py_None);
            int failed = value == NULL || PyDict_SetItem(out, key, value) < 0;
            Py_DECREF(key);
            Py_XDECREF(value);
            if (failed)
                goto fail;
        }
        else if (skip(b, &pos, stop, tag, known_first) < 0)
            goto fail;
    }
    if (pos > stop) {
        unusual("field runs past its key-value list");
        goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* An AnyValue as plain Python, as collectors.attributes.any_value makes it. */
static PyObject *
any_value(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, Py_ssize_t depth)
{
    PyObject *result = Py_NewRef(Py_None);
    uint64_t tag, value, field;
    Py_ssize_t start, end;
    int seen = 0, over;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            goto fail;
        field = tag >> 3;
        if (field >= 1 && field <= 8) {
            if (seen) {
                unusual("an AnyValue with two members");
                goto fail;
            }
            seen = 1;
        }
        PyObject *next = NULL;
        if (tag == 0x0A) {
            if (length(b, &pos, stop, &start, &end) < 0 || (next = text(b, start, end)) == NULL)
                goto fail;
            if (PyUnicode_GET_LENGTH(next) > max_string_chars && (next = cut(next, max_string_chars)) == NULL)
                goto fail;
        }
        else if (tag == 0x18) {
            if (varint(b, &pos, &value, &over) < 0 || (next = PyLong_FromLongLong((int64_t)value)) == NULL)
                goto fail;
        }
        else if (tag == 0x10) {
            if (varint(b, &pos, &value, &over) < 0)
                goto fail;
            next = PyBool_FromLong(value != 0);
        }
        else if (tag == 0x21) {
            double number;
            if (pos < 0 || pos > b->len - 8) {
                unusual("double runs past the body");
                goto fail;
            }
            uint64_t bits = le64(b->data + pos);
            memcpy(&number, &bits, sizeof number);
            pos += 8;
            if ((next = PyFloat_FromDouble(number)) == NULL)
                goto fail;
            if (!isfinite(number)) {
                PyObject *shown = PyObject_Str(next);
                Py_DECREF(next);
                if ((next = shown) == NULL)
                    goto fail;
            }
        }
        else if (tag == 0x3A) {
            if (length(b, &pos, stop, &start, &end) < 0)
                goto fail;
            next = PyObject_CallFunction(hex_fn, "y#", (const char *)b->data + start, end - start);
            if (next == NULL)
                goto fail;
        }
        else if (tag == 0x2A || tag == 0x32) {
            if (length(b, &pos, stop, &start, &end) < 0)
                goto fail;
            if (depth >= max_depth) {
                unusual("values nested deeper than are kept");
                goto fail;
            }
            next = (tag == 0x2A ? array : kvlist)(b, start, end, depth + 1);
            if (next == NULL)
                goto fail;
        }
        else if (skip(b, &pos, stop, tag, known_any_value) < 0)
            goto fail;
        if (next != NULL)
            Py_SETREF(result, next);
    }
    if (pos > stop) {
        unusual("field runs past its value");
        goto fail;
    }
    return result;
fail:
    Py_DECREF(result);
    return NULL;
}

/* A span's or resource's key-value, from its own bytes: (key, value), remembered by those bytes
 * when the value cannot be changed in place. Returns a new reference to the pair. */
static PyObject *
key_value(PyObject *raw)
{
    PyObject *pair = PyDict_GetItemWithError(kv_cache, raw), *key, *value;
    Py_ssize_t vstart = 0, vend = 0;
    int has_value;
    if (pair != NULL)
        return Py_NewRef(pair);
    if (PyErr_Occurred())
        return NULL;
    Buf b = {(const unsigned char *)PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw)};
    if ((key = kv_parts(&b, 0, b.len, &has_value, &vstart, &vend)) == NULL)
        return NULL;
    value = has_value ? any_value(&b, vstart, vend, 0) : Py_NewRef(Py_None);
    if (value == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    pair = PyTuple_Pack(2, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
    if (pair == NULL)
        return NULL;
    if (!PyList_CheckExact(value) && !PyDict_CheckExact(value) && b.len <= kv_cache_bytes) {
        if (PyDict_GET_SIZE(kv_cache) >= kv_cache_max)
            PyDict_Clear(kv_cache);
        if (PyDict_SetItem(kv_cache, raw, pair) < 0) {
            Py_DECREF(pair);
            return NULL;
        }
    }
    return pair;
}

/* One attribute field's bytes into attrs: the first of a key wins. */
static int
add_attribute(PyObject *attrs, const Buf *b, Py_ssize_t start, Py_ssize_t end)
{
    PyObject *raw = PyBytes_FromStringAndSize((const char *)b->data + start, end - start), *pair;
    if (raw == NULL)
        return -1;
    pair = key_value(raw);
    Py_DECREF(raw);
    if (pair == NULL)
        return -1;
    int failed = PyDict_SetDefault(attrs, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) == NULL;
    Py_DECREF(pair);
    return failed ? -1 : 0;
}

/* -- the sub-messages not kept: read through with the same checks, then dropped ------------------- */
/* A key-value read as a kept one is (the same checks, the same limits), then dropped. */
static int
read_key_value(const Buf *b, Py_ssize_t pos, Py_ssize_t stop)
{
    Py_ssize_t vstart = 0, vend = 0;
    int has_value;
    PyObject *key = kv_parts(b, pos, stop, &has_value, &vstart, &vend), *value;
    if (key == NULL)
        return -1;
    Py_DECREF(key);
    if (!has_value)
        return 0;
    if ((value = any_value(b, vstart, vend, 0)) == NULL)
        return -1;
    Py_DECREF(value);
    return 0;
}

/* Each one's fields by tag, as what each holds; a table ends at tag 0 (never a field's). */
enum { TEXT, BYTES, KEY_VALUE, VARINT, FIXED64, FIXED32 };
typedef struct {
    uint64_t tag;
    int kind;
} Field;
static const Field scope_fields[] = { /* name, version, attributes, dropped */
    {0x0A, TEXT}, {0x12, TEXT}, {0x1A, KEY_VALUE}, {0x20, VARINT}, {0, 0}};
static const Field event_fields[] = { /* time, name, attributes, dropped */
    {0x09, FIXED64}, {0x12, TEXT}, {0x1A, KEY_VALUE}, {0x20, VARINT}, {0, 0}};
static const Field link_fields[] = { /* trace and span ids, trace_state, attributes, dropped, flags */
    {0x0A, BYTES}, {0x12, BYTES}, {0x1A, TEXT}, {0x22, KEY_VALUE}, {0x28, VARINT}, {0x35, FIXED32}, {0, 0}};

/* A message read field by field as fields says and dropped; its other fields as skip says. */
static int
read_through(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, const Field *fields, uint64_t known, const char *past)
{
    uint64_t tag, value;
    Py_ssize_t start, end;
    int over, kind;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            return -1;
        kind = -1;
        for (const Field *f = fields; f->tag != 0; f++)
            if (f->tag == tag) {
                kind = f->kind;
                break;
            }
        if (kind < 0) {
            if (skip(b, &pos, stop, tag, known) < 0)
                return -1;
        }
        else if (kind == VARINT) {
            if (varint(b, &pos, &value, &over) < 0)
                return -1;
        }
        else if (kind == FIXED64 || kind == FIXED32)
            pos += kind == FIXED64 ? 8 : 4;
        else {
            if (length(b, &pos, stop, &start, &end) < 0)
                return -1;
            if (kind == TEXT && valid_text(b, start, end) < 0)
                return -1;
            if (kind == KEY_VALUE && read_key_value(b, start, end) < 0)
                return -1;
        }
    }
    if (pos > stop)
        return unusual(past);
    return 0;
}

static int
scope(const Buf *b, Py_ssize_t pos, Py_ssize_t stop)
{
    return read_through(b, pos, stop, scope_fields, known_scope, "field runs past its scope");
}

static int
span_event(const Buf *b, Py_ssize_t pos, Py_ssize_t stop)
{
    return read_through(b, pos, stop, event_fields, known_event, "field runs past its event");
}

static int
span_link(const Buf *b, Py_ssize_t pos, Py_ssize_t stop)
{
    return read_through(b, pos, stop, link_fields, known_link, "field runs past its link");
}

/* -- the request, its resources, scopes and spans ------------------------------------------------ */
static int
status(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, int32_t *code)
{
    uint64_t tag, value;
    Py_ssize_t start, end;
    int over;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            return -1;
        if (tag == 0x18) {
            if (varint(b, &pos, &value, &over) < 0)
                return -1;
            *code = (int32_t)(uint32_t)value;
        }
        else if (tag == 0x12) {
            if (length(b, &pos, stop, &start, &end) < 0 || valid_text(b, start, end) < 0)
                return -1;
        }
        else if (skip(b, &pos, stop, tag, known_status) < 0)
            return -1;
    }
    if (pos > stop)
        return unusual("field runs past its status");
    return 0;
}

static PyObject *
span(const Buf *b, Py_ssize_t pos, Py_ssize_t stop)
{
    Py_ssize_t ids[3][2] = {{0, 0}, {0, 0}, {0, 0}}; /* trace, span, parent: [start, end) */
    PyObject *name = NULL, *attrs = PyDict_New(), *out = NULL;
    uint64_t start_ns = 0, end_ns = 0, value, tag;
    int32_t kind = 0, code = 0;
    int has_status = 0, over;
    Py_ssize_t count = 0, start;
    if (attrs == NULL)
        return NULL;
    while (pos < stop) {
        unsigned first = b->data[pos++];
        if ((first & 7) == 2 && first < 0x80) { /* length-delimited: its bounds first */
            if (pos >= b->len) {
                unusual("length runs past the body");
                goto done;
            }
            value = b->data[pos];
            if (value < 0x80)
                pos++;
            else if (varint(b, &pos, &value, &over) < 0)
                goto done;
            else if (over) {
                unusual("field runs past its span");
                goto done;
            }
            start = pos;
            if (pos > stop || value > (uint64_t)(stop - pos)) {
                unusual("field runs past its span");
                goto done;
            }
            pos += (Py_ssize_t)value;
            if (first == 0x4A) { /* attributes */
                count++;
                if (add_attribute(attrs, b, start, pos) < 0)
                    goto done;
            }
            else if (first == 0x0A || first == 0x12 || first == 0x22) {
                int which = first == 0x0A ? 0 : first == 0x12 ? 1 : 2;
                ids[which][0] = start;
                ids[which][1] = pos;
            }
            else if (first == 0x2A) {
                Py_XDECREF(name);
                if ((name = text(b, start, pos)) == NULL)
                    goto done;
            }
            else if (first == 0x7A) { /* status: occurrences merge, field by field */
                has_status = 1;
                if (status(b, start, pos, &code) < 0)
                    goto done;
            }
            else if (first == 0x1A) { /* trace_state */
                if (valid_text(b, start, pos) < 0)
                    goto done;
            }
            else if (first == 0x5A || first == 0x6A) { /* events, links: not kept, but read through */
                if ((first == 0x5A ? span_event(b, start, pos) : span_link(b, start, pos)) < 0)
                    goto done;
            }
            else if (first < 8 || is_known(known_span, first >> 3)) {
                unusual("a known span field with a wire type this reader does not take");
                goto done;
            }
        }
        else if (first == 0x39 || first == 0x41) {
            if (pos > b->len - 8) {
                unusual("fixed64 runs past the body");
                goto done;
            }
            *(first == 0x39 ? &start_ns : &end_ns) = le64(b->data + pos);
            pos += 8;
        }
        else if (first == 0x30) {
            if (varint(b, &pos, &value, &over) < 0)
                goto done;
            kind = (int32_t)(uint32_t)value;
        }
        else if (first == 0x50 || first == 0x60 || first == 0x70) { /* dropped counts */
            if (varint(b, &pos, &value, &over) < 0)
                goto done;
        }
        else if (first == 0x85 && pos < b->len && b->data[pos] == 0x01) { /* flags, fixed32 */
            pos += 5;
        }
        else {
            if (first == 0x85 && pos >= b->len) {
                unusual("tag runs past the body");
                goto done;
            }
            pos--;
            if (tag_at(b, &pos, &tag) < 0 || skip(b, &pos, stop, tag, known_span) < 0)
                goto done;
        }
        if (pos > stop) {
            unusual("field runs past its span");
            goto done;
        }
    }
    if (count > max_attributes) {
        unusual("more attributes than are kept");
        goto done;
    }
    if (name == NULL && (name = PyUnicode_FromStringAndSize("", 0)) == NULL)
        goto done;
    out = Py_BuildValue("(y#y#y#KKOiNO)",
                        (const char *)b->data + ids[0][0], ids[0][1] - ids[0][0],
                        (const char *)b->data + ids[1][0], ids[1][1] - ids[1][0],
                        (const char *)b->data + ids[2][0], ids[2][1] - ids[2][0],
                        (unsigned long long)start_ns, (unsigned long long)end_ns, name, (int)kind,
                        has_status ? PyLong_FromLong(code) : Py_NewRef(Py_None), attrs);
done:
    Py_XDECREF(name);
    Py_DECREF(attrs);
    return out;
}

static int
scope_spans(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, PyObject *spans)
{
    uint64_t tag;
    Py_ssize_t start, end;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            return -1;
        if (tag == 0x12) {
            if (length(b, &pos, stop, &start, &end) < 0)
                return -1;
            PyObject *parts = span(b, start, end);
            if (parts == NULL)
                return -1;
            int failed = PyList_Append(spans, parts);
            Py_DECREF(parts);
            if (failed)
                return -1;
        }
        else if (tag == 0x0A) { /* scope: not kept, but read through */
            if (length(b, &pos, stop, &start, &end) < 0 || scope(b, start, end) < 0)
                return -1;
        }
        else if (tag == 0x1A) { /* schema_url */
            if (length(b, &pos, stop, &start, &end) < 0 || valid_text(b, start, end) < 0)
                return -1;
        }
        else if (skip(b, &pos, stop, tag, known_scope_spans) < 0)
            return -1;
    }
    if (pos > stop)
        return unusual("field runs past its scope spans");
    return 0;
}

static int
resource(const Buf *b, Py_ssize_t pos, Py_ssize_t stop, PyObject *attrs, Py_ssize_t *count)
{
    uint64_t tag, value;
    Py_ssize_t start, end;
    int over;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            return -1;
        if (tag == 0x0A) {
            if (length(b, &pos, stop, &start, &end) < 0)
                return -1;
            if (++*count > max_attributes)
                return unusual("more attributes than are kept");
            if (add_attribute(attrs, b, start, end) < 0)
                return -1;
        }
        else if (tag == 0x10) { /* dropped_attributes_count */
            if (varint(b, &pos, &value, &over) < 0)
                return -1;
        }
        else if (skip(b, &pos, stop, tag, known_resource) < 0)
            return -1;
    }
    if (pos > stop)
        return unusual("field runs past its resource");
    return 0;
}

static PyObject *
resource_spans(const Buf *b, Py_ssize_t pos, Py_ssize_t stop)
{
    PyObject *attrs = PyDict_New(), *spans = PyList_New(0), *out = NULL;
    uint64_t tag;
    Py_ssize_t start, end, count = 0;
    if (attrs == NULL || spans == NULL)
        goto done;
    while (pos < stop) {
        if (tag_at(b, &pos, &tag) < 0)
            goto done;
        if (tag == 0x12) {
            if (length(b, &pos, stop, &start, &end) < 0 || scope_spans(b, start, end, spans) < 0)
                goto done;
        }
        else if (tag == 0x0A) { /* resource: occurrences merge, their attributes append */
            if (length(b, &pos, stop, &start, &end) < 0 || resource(b, start, end, attrs, &count) < 0)
                goto done;
        }
        else if (tag == 0x1A) { /* schema_url */
            if (length(b, &pos, stop, &start, &end) < 0 || valid_text(b, start, end) < 0)
                goto done;
        }
        else if (skip(b, &pos, stop, tag, known_resource_spans) < 0)
            goto done;
    }
    if (pos > stop) {
        unusual("field runs past its resource spans");
        goto done;
    }
    out = PyTuple_Pack(2, attrs, spans);
done:
    Py_XDECREF(attrs);
    Py_XDECREF(spans);
    return out;
}

static PyObject *
read_request(PyObject *self, PyObject *arg)
{
    PyObject *out, *item;
    uint64_t tag;
    Py_ssize_t pos = 0, start, end;
    if (Unusual == NULL)
        return PyErr_Format(PyExc_RuntimeError, "configure() was not called");
    if (!PyBytes_Check(arg))
        return PyErr_Format(PyExc_TypeError, "a body is bytes, not %.100s", Py_TYPE(arg)->tp_name);
    Buf b = {(const unsigned char *)PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)};
    if ((out = PyList_New(0)) == NULL)
        return NULL;
    while (pos < b.len) {
        if (tag_at(&b, &pos, &tag) < 0)
            goto fail;
        if (tag == 0x0A) {
            if (length(&b, &pos, b.len, &start, &end) < 0 || (item = resource_spans(&b, start, end)) == NULL)
                goto fail;
            int failed = PyList_Append(out, item);
            Py_DECREF(item);
            if (failed)
                goto fail;
        }
        else if (skip(&b, &pos, b.len, tag, known_request) < 0)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* -- set-up ---------------------------------------------------------------------------------------- */
static int
bits_of(PyObject *numbers, uint64_t *out)
{
    PyObject *iter = PyObject_GetIter(numbers), *item;
    *out = 0;
    if (iter == NULL)
        return -1;
    while ((item = PyIter_Next(iter)) != NULL) {
        long number = PyLong_AsLong(item);
        Py_DECREF(item);
        if (number == -1 && PyErr_Occurred())
            break;
        if (number < 0 || number >= 64) {
            PyErr_Format(PyExc_ValueError, "field number %ld is outside 0-63", number);
            break;
        }
        *out |= (uint64_t)1 << number;
    }
    Py_DECREF(iter);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *unusual_cls, *cut_text, *hex_text, *cache, *limits, *known;
    uint64_t bits[11];
    if (!PyArg_ParseTuple(args, "OOOO!O!O!:configure", &unusual_cls, &cut_text, &hex_text,
                          &PyDict_Type, &cache, &PyTuple_Type, &limits, &PyTuple_Type, &known))
        return NULL;
    if (!PyArg_ParseTuple(limits, "nnnnnnn:limits", &max_attributes, &max_string_chars, &max_array_items,
                          &max_depth, &max_key_chars, &kv_cache_max, &kv_cache_bytes))
        return NULL;
    if (PyTuple_GET_SIZE(known) != 11)
        return PyErr_Format(PyExc_ValueError, "known: 11 sets of field numbers, not %zd", PyTuple_GET_SIZE(known));
    for (int i = 0; i < 11; i++)
        if (bits_of(PyTuple_GET_ITEM(known, i), &bits[i]) < 0)
            return NULL;
    known_request = bits[0];
    known_resource_spans = bits[1];
    known_resource = bits[2];
    known_scope_spans = bits[3];
    known_span = bits[4];
    known_status = bits[5];
    known_any_value = bits[6];
    known_key_value = bits[7];
    known_scope = bits[8];
    known_event = bits[9];
    known_link = bits[10];
    Py_XSETREF(Unusual, Py_NewRef(unusual_cls));
    Py_XSETREF(cut_fn, Py_NewRef(cut_text));
    Py_XSETREF(hex_fn, Py_NewRef(hex_text));
    Py_XSETREF(kv_cache, Py_NewRef(cache));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(unusual, cut_text, hex_text, cache, limits, known): what the reader leaves to Python."},
    {"read_request", read_request, METH_O,
     "read_request(body) -> [(resource attributes, [span parts])]; raises Unusual as otlp_wire does."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_otlp_wire",
    .m_doc = "The compiled twin of collectors.otlp_wire's reader.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__otlp_wire(void)
{
    return PyModule_Create(&module);
}
