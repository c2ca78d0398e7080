/* The span record builder of collectors/normalize.py (build_span), compiled.
 *
 * normalize.build_span is the reference: this file follows it step for step, in its order (a value
 * taken into a column is removed from the attributes, so the order is part of the answer), and
 * takes every rule's data from it through configure(): the attribute keys of each column, the
 * column widths, the kind and status names, the roles. A rule changed there is changed here only
 * where it is control flow; tests/test_normalize_compiled.py calls both builders on generated
 * spans and must find the same record, the same attributes left and the same exception.
 *
 * The hot cases are C: exact str, int and float values, and dict lookups. Everything else goes to
 * the reference's own functions, given to configure(): a value as int or float when it is not
 * already one (a string "200", a float 8000.0), "host:port" parsing, the engine-span test (the
 * configured names can change while the daemon runs) and cutting long texts. The record itself is
 * made by normalize._new_span, as the Python builder makes it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <string.h>
#include <structmember.h>

/* Set by configure(). */
static PyObject *new_span_fn;   /* normalize._new_span: the record from its 27 values in order */
static PyTypeObject *record_type; /* SpanRecord, where its slots are filled here (else NULL) */
static PyObject *engine_fn;     /* attributes.is_engine_span(name, kind, attrs, http) */
static PyObject *hostport_fn;   /* attributes.port_from_hostport(text) */
static PyObject *cut_fn;        /* attributes.cut_text(text, limit) */
static PyObject *as_int_fn;     /* attributes.as_int, for values other than an exact int or a bool */
static PyObject *as_float_fn;   /* attributes.as_float, for values other than an exact float */
static PyObject *as_finish_fn;  /* attributes.as_finish, for finish reasons sent as JSON text */
static PyObject *kind_names, *status_names, *genai_keys;
static PyObject *role_engine, *role_server, *role_client, *role_other;
static PyObject *text_unset, *text_unspecified, *text_empty, *dropped_key;
static Py_ssize_t name_chars, peer_addr_chars, request_id_chars, route_chars, model_chars, finish_chars;

/* The keys of each column, most specific first (normalize.py's tuples), and the single keys. */
enum {
    K_METHOD, K_PEER_ADDR, K_PEER_PORT, K_SERVER_PORT, K_HOST_HEADER, K_URL, K_CLIENT_PEER_ADDR,
    K_CLIENT_PEER_PORT, K_REQUEST_ID_HEADER, K_STATUS, K_TARGET, K_PID, K_FINISH, K_MODEL, K_PROMPT,
    K_COMPLETION, N_KEY_TUPLES
};
enum { S_ROUTE, S_GENAI_REQUEST_ID, S_MAX_TOKENS, S_TIME_IN_QUEUE, S_TIME_TO_FIRST_TOKEN, N_SINGLE_KEYS };
static PyObject *key_tuples[N_KEY_TUPLES];
static PyObject *single_keys[N_SINGLE_KEYS];

/* -- typed reads (attributes.as_*): a new reference, Py_None where the value reads as missing -- */
typedef PyObject *(*convert_fn)(PyObject *value);

static PyObject *
as_str(PyObject *value)
{
    if (PyUnicode_CheckExact(value))
        return Py_NewRef(value);
    if (PyList_Check(value)) {
        if (PyList_GET_SIZE(value) == 0)
            Py_RETURN_NONE;
        value = PyList_GET_ITEM(value, 0);
    }
    if (PyUnicode_Check(value))
        return Py_NewRef(value);
    Py_RETURN_NONE;
}

static PyObject *
as_finish(PyObject *value)
{
    PyObject *text = as_str(value);
    if (text == NULL || !PyUnicode_Check(text) || PyUnicode_GET_LENGTH(text) == 0 ||
        PyUnicode_READ_CHAR(text, 0) != '[')
        return text;
    Py_SETREF(text, PyObject_CallOneArg(as_finish_fn, text));
    return text;
}

static PyObject *
as_int(PyObject *value)
{
    if (PyBool_Check(value))
        Py_RETURN_NONE;
    if (PyLong_CheckExact(value))
        return Py_NewRef(value);
    return PyObject_CallOneArg(as_int_fn, value);
}

/* as_int, kept where low <= value <= high. */
static PyObject *
as_int_within(PyObject *value, long long low, long long high)
{
    PyObject *number = as_int(value);
    int overflow;
    if (number == NULL || number == Py_None)
        return number;
    long long n = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        Py_DECREF(number);
        return NULL;
    }
    if (overflow || n < low || n > high) {
        Py_DECREF(number);
        Py_RETURN_NONE;
    }
    return number;
}

static PyObject *
as_port(PyObject *value)
{
    return as_int_within(value, 0, 65535);
}

static PyObject *
as_pid(PyObject *value)
{
    return as_int_within(value, 1, 2147483647LL);
}

static PyObject *
as_count(PyObject *value)
{
    return as_int_within(value, 0, 2147483647LL);
}

static PyObject *
as_float(PyObject *value)
{
    if (PyFloat_CheckExact(value)) {
        if (isfinite(PyFloat_AS_DOUBLE(value)))
            return Py_NewRef(value);
        Py_RETURN_NONE;
    }
    return PyObject_CallOneArg(as_float_fn, value);
}

/* -- reads of the attributes (attributes.first_of, take, take_one) ----------------------------- */

/* The value of the first of keys that is neither None nor "" (a new reference), else Py_None. */
static PyObject *
first_of(PyObject *attrs, PyObject *keys)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); i++) {
        PyObject *value = PyDict_GetItemWithError(attrs, PyTuple_GET_ITEM(keys, i));
        if (value == NULL) {
            if (PyErr_Occurred())
                return NULL;
            continue;
        }
        if (value == Py_None)
            continue;
        int filled;
        if (PyUnicode_CheckExact(value))
            filled = PyUnicode_GET_LENGTH(value) != 0;
        else if ((filled = PyObject_RichCompareBool(value, text_empty, Py_NE)) < 0)
            return NULL;
        if (filled)
            return Py_NewRef(value);
    }
    Py_RETURN_NONE;
}

/* The first of keys whose value converts, removed from attrs; aliases holding the same value go
 * too, an alias that disagrees stays. A new reference, Py_None where none converts. */
static PyObject *
take(PyObject *attrs, PyObject *keys, convert_fn convert)
{
    PyObject *chosen = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        PyObject *value = PyDict_GetItemWithError(attrs, key);
        if (value == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        if (value == Py_None)
            continue;
        Py_INCREF(value); /* a conversion in Python may run any code */
        PyObject *converted = convert(value);
        Py_DECREF(value);
        if (converted == NULL)
            goto fail;
        if (converted == Py_None) {
            Py_DECREF(converted);
            continue;
        }
        if (chosen == NULL)
            chosen = Py_NewRef(converted);
        int same = PyObject_RichCompareBool(converted, chosen, Py_EQ);
        Py_DECREF(converted);
        if (same < 0 || (same && PyDict_DelItem(attrs, key) < 0))
            goto fail;
    }
    return chosen != NULL ? chosen : Py_NewRef(Py_None);
fail:
    Py_XDECREF(chosen);
    return NULL;
}

static PyObject *
take_one(PyObject *attrs, PyObject *key, convert_fn convert)
{
    PyObject *value = PyDict_GetItemWithError(attrs, key);
    if (value == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    if (value == Py_None)
        Py_RETURN_NONE;
    Py_INCREF(value);
    PyObject *converted = convert(value);
    Py_DECREF(value);
    if (converted != NULL && converted != Py_None && PyDict_DelItem(attrs, key) < 0)
        Py_CLEAR(converted);
    return converted;
}

/* port_from_hostport(value): None for anything but a non-empty text, as it answers itself. */
static PyObject *
hostport(PyObject *value)
{
    if (!PyUnicode_Check(value) || PyUnicode_GET_LENGTH(value) == 0)
        Py_RETURN_NONE;
    return PyObject_CallOneArg(hostport_fn, value);
}

/* attributes.cut_text(text, width): a new reference. */
static PyObject *
cut(PyObject *text, Py_ssize_t width)
{
    PyObject *limit = PyLong_FromSsize_t(width);
    if (limit == NULL)
        return NULL;
    PyObject *out = PyObject_CallFunctionObjArgs(cut_fn, text, limit, NULL);
    Py_DECREF(limit);
    return out;
}

/* normalize._opt_cut: a column's text (None, or a str from as_str) cut to its width, in place. */
static int
opt_cut(PyObject **slot, Py_ssize_t width)
{
    if (*slot == Py_None || PyUnicode_GET_LENGTH(*slot) <= width)
        return 0;
    Py_SETREF(*slot, cut(*slot, width));
    return *slot == NULL ? -1 : 0;
}

/* -- the record ---------------------------------------------------------------------------------- */
enum {
    F_TRACE_ID, F_SPAN_ID, F_PARENT_SPAN_ID, F_NAME, F_KIND, F_START_NS, F_END_NS, F_SERVICE, F_HOST, F_STATUS,
    F_ROLE, F_PEER_ADDR, F_PEER_PORT, F_SERVER_PORT, F_REQUEST_ID, F_ROUTE, F_MODEL, F_HTTP_STATUS,
    F_FINISH_REASON, F_PROMPT_TOKENS, F_COMPLETION_TOKENS, F_MAX_TOKENS, F_TIME_IN_QUEUE_S,
    F_TIME_TO_FIRST_TOKEN_S, F_PROCESS_PID, F_PEER_REWRITTEN, F_ATTRIBUTES, N_FIELDS
};

/* The record's fields, in the order of normalize._SPAN_FIELDS (configure() checks it). */
static const char *field_names[N_FIELDS] = {
    "trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns", "service", "host", "status",
    "role", "peer_addr", "peer_port", "server_port", "request_id", "route", "model", "http_status",
    "finish_reason", "prompt_tokens", "completion_tokens", "max_tokens", "time_in_queue_s",
    "time_to_first_token_s", "process_pid", "peer_rewritten", "attributes"};
static Py_ssize_t field_offsets[N_FIELDS]; /* where record_type keeps each field */

/* The record from its fields, whose references it takes (each slot of f is NULL after). As
 * normalize._slot_filler does in Python, the slots are set directly (the frozen dataclass's
 * __setattr__ refuses, and its __init__ costs ten times as much); without record_type, the
 * Python builder of the record is called. */
static PyObject *
new_record(PyObject **f)
{
    if (record_type == NULL)
        return PyObject_Vectorcall(new_span_fn, f, N_FIELDS, NULL);
    PyObject *record = record_type->tp_alloc(record_type, 0);
    if (record == NULL)
        return NULL;
    for (int i = 0; i < N_FIELDS; i++) {
        *(PyObject **)((char *)record + field_offsets[i]) = f[i];
        f[i] = NULL;
    }
    return record;
}

/* The server or client columns of an HTTP span (normalize._connection), into f. */
static int
connection(PyObject *attrs, PyObject *role, PyObject **f)
{
    PyObject *text;
    if (role == role_server) {
        if ((f[F_PEER_ADDR] = take(attrs, key_tuples[K_PEER_ADDR], as_str)) == NULL ||
            (f[F_PEER_PORT] = take(attrs, key_tuples[K_PEER_PORT], as_port)) == NULL ||
            (f[F_SERVER_PORT] = take(attrs, key_tuples[K_SERVER_PORT], as_port)) == NULL)
            return -1;
        /* Old ASGI versions only say "host:port" (scope server, else the Host header). */
        for (int k = K_HOST_HEADER; k <= K_URL && f[F_SERVER_PORT] == Py_None; k++) {
            if ((text = first_of(attrs, key_tuples[k])) == NULL)
                return -1;
            Py_SETREF(f[F_SERVER_PORT], hostport(text));
            Py_DECREF(text);
            if (f[F_SERVER_PORT] == NULL)
                return -1;
        }
        /* A proxy header's peer (port 0 or none) no longer names the TCP connection. */
        int rewritten = 0;
        if (f[F_PEER_ADDR] != Py_None && (rewritten = PyObject_Not(f[F_PEER_PORT])) < 0)
            return -1;
        f[F_PEER_REWRITTEN] = Py_NewRef(rewritten ? Py_True : Py_False);
        return 0;
    }
    f[F_PEER_PORT] = Py_NewRef(Py_None);
    f[F_PEER_REWRITTEN] = Py_NewRef(Py_False);
    if (role == role_client) {
        if ((f[F_SERVER_PORT] = take(attrs, key_tuples[K_CLIENT_PEER_PORT], as_port)) == NULL)
            return -1;
        if (f[F_SERVER_PORT] == Py_None) {
            if ((text = first_of(attrs, key_tuples[K_URL])) == NULL)
                return -1;
            Py_SETREF(f[F_SERVER_PORT], hostport(text));
            Py_DECREF(text);
            if (f[F_SERVER_PORT] == NULL)
                return -1;
        }
        f[F_PEER_ADDR] = take(attrs, key_tuples[K_CLIENT_PEER_ADDR], as_str);
        return f[F_PEER_ADDR] == NULL ? -1 : 0;
    }
    f[F_PEER_ADDR] = Py_NewRef(Py_None);
    f[F_SERVER_PORT] = Py_NewRef(Py_None);
    return 0;
}

/* Whether any of the attributes' keys is a GenAI one (not _GENAI_KEYS.isdisjoint(attrs)). */
static int
has_genai_key(PyObject *attrs)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        int found = PySet_Contains(genai_keys, key);
        if (found != 0)
            return found;
    }
    return 0;
}

static int
is_text(PyObject *value, const char *text)
{
    return PyUnicode_Check(value) && PyUnicode_CompareWithASCIIString(value, text) == 0;
}

static PyObject *
build_span(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *f[N_FIELDS] = {NULL};
    PyObject *head, *name, *kind_code, *status_code, *attrs, *dropped, *service, *host, *process_pid;
    PyObject *method = NULL, *kind, *role, *out = NULL;
    if (new_span_fn == NULL)
        return PyErr_Format(PyExc_RuntimeError, "configure() was not called");
    if (nargs != 9)
        return PyErr_Format(PyExc_TypeError, "build_span takes 9 arguments (%zd given)", nargs);
    head = args[0], name = args[1], kind_code = args[2], status_code = args[3], attrs = args[4];
    dropped = args[5], service = args[6], host = args[7], process_pid = args[8];
    if (!PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 5)
        return PyErr_Format(PyExc_TypeError, "head is check_head's 5-tuple");
    if (!PyDict_Check(attrs))
        return PyErr_Format(PyExc_TypeError, "attrs is a dict, not %.100s", Py_TYPE(attrs)->tp_name);

    Py_ssize_t name_length = PyObject_Length(name);
    if (name_length < 0)
        return NULL;
    f[F_NAME] = name_length > name_chars ? cut(name, name_chars) : Py_NewRef(name);
    if (f[F_NAME] == NULL)
        goto done;
    if ((kind = PyDict_GetItemWithError(kind_names, kind_code)) == NULL && PyErr_Occurred())
        goto done;
    f[F_KIND] = Py_NewRef(kind != NULL ? kind : text_unspecified);
    if ((method = first_of(attrs, key_tuples[K_METHOD])) == NULL)
        goto done;
    int is_http = method != Py_None;

    PyObject *engine = PyObject_CallFunctionObjArgs(engine_fn, f[F_NAME], f[F_KIND], attrs,
                                                    is_http ? Py_True : Py_False, NULL);
    if (engine == NULL)
        goto done;
    int is_engine = PyObject_IsTrue(engine);
    Py_DECREF(engine);
    if (is_engine < 0)
        goto done;
    if (is_engine)
        role = role_engine;
    else if (is_http && is_text(f[F_KIND], "server"))
        role = role_server;
    else if (is_http && is_text(f[F_KIND], "client"))
        role = role_client;
    else
        role = role_other;
    f[F_ROLE] = Py_NewRef(role);

    if (connection(attrs, role, f) < 0)
        goto done;
    int has_genai = role == role_engine;
    if (!has_genai && (has_genai = has_genai_key(attrs)) < 0)
        goto done;

    /* The request id (normalize._request_id). */
    PyObject *request_id = NULL;
    if (is_http && role != role_engine) {
        if ((request_id = take(attrs, key_tuples[K_REQUEST_ID_HEADER], as_str)) == NULL)
            goto done;
    }
    if ((request_id == NULL || request_id == Py_None) && (has_genai || role == role_engine)) {
        Py_XDECREF(request_id);
        if ((request_id = take_one(attrs, single_keys[S_GENAI_REQUEST_ID], as_str)) == NULL)
            goto done;
    }
    f[F_REQUEST_ID] = request_id != NULL ? request_id : Py_NewRef(Py_None);

    if (is_http) {
        if ((f[F_ROUTE] = take_one(attrs, single_keys[S_ROUTE], as_str)) == NULL)
            goto done;
        if (f[F_ROUTE] == Py_None) {
            PyObject *target = first_of(attrs, key_tuples[K_TARGET]);
            if (target == NULL)
                goto done;
            if (PyUnicode_Check(target)) {
                Py_ssize_t length = PyUnicode_GET_LENGTH(target);
                Py_ssize_t at = PyUnicode_FindChar(target, '?', 0, length, 1);
                Py_SETREF(f[F_ROUTE], at == -2 ? NULL : PyUnicode_Substring(target, 0, at < 0 ? length : at));
            }
            Py_DECREF(target);
            if (f[F_ROUTE] == NULL)
                goto done;
        }
        if ((f[F_HTTP_STATUS] = take(attrs, key_tuples[K_STATUS], as_count)) == NULL)
            goto done;
    }
    else {
        f[F_ROUTE] = Py_NewRef(Py_None);
        f[F_HTTP_STATUS] = Py_NewRef(Py_None);
    }
    if (process_pid != Py_None)
        f[F_PROCESS_PID] = Py_NewRef(process_pid);
    else if ((f[F_PROCESS_PID] = take(attrs, key_tuples[K_PID], as_pid)) == NULL)
        goto done;

    /* The GenAI and vLLM engine columns (normalize._engine_columns). */
    if (has_genai) {
        if ((f[F_FINISH_REASON] = take(attrs, key_tuples[K_FINISH], as_finish)) == NULL ||
            (f[F_MODEL] = take(attrs, key_tuples[K_MODEL], as_str)) == NULL ||
            (f[F_PROMPT_TOKENS] = take(attrs, key_tuples[K_PROMPT], as_count)) == NULL ||
            (f[F_COMPLETION_TOKENS] = take(attrs, key_tuples[K_COMPLETION], as_count)) == NULL ||
            (f[F_MAX_TOKENS] = take_one(attrs, single_keys[S_MAX_TOKENS], as_count)) == NULL ||
            (f[F_TIME_IN_QUEUE_S] = take_one(attrs, single_keys[S_TIME_IN_QUEUE], as_float)) == NULL ||
            (f[F_TIME_TO_FIRST_TOKEN_S] = take_one(attrs, single_keys[S_TIME_TO_FIRST_TOKEN], as_float)) == NULL)
            goto done;
    }
    else {
        int engine_fields[] = {F_FINISH_REASON, F_MODEL, F_PROMPT_TOKENS, F_COMPLETION_TOKENS, F_MAX_TOKENS,
                               F_TIME_IN_QUEUE_S, F_TIME_TO_FIRST_TOKEN_S};
        for (size_t i = 0; i < sizeof engine_fields / sizeof engine_fields[0]; i++)
            f[engine_fields[i]] = Py_NewRef(Py_None);
    }
    int any_dropped = PyObject_IsTrue(dropped);
    if (any_dropped < 0 || (any_dropped && PyDict_SetItem(attrs, dropped_key, dropped) < 0))
        goto done;

    f[F_TRACE_ID] = Py_NewRef(PyTuple_GET_ITEM(head, 0));
    f[F_SPAN_ID] = Py_NewRef(PyTuple_GET_ITEM(head, 1));
    f[F_PARENT_SPAN_ID] = Py_NewRef(PyTuple_GET_ITEM(head, 2));
    f[F_START_NS] = Py_NewRef(PyTuple_GET_ITEM(head, 3));
    f[F_END_NS] = Py_NewRef(PyTuple_GET_ITEM(head, 4));
    f[F_SERVICE] = Py_NewRef(service);
    f[F_HOST] = Py_NewRef(host);
    if (status_code == Py_None)
        f[F_STATUS] = Py_NewRef(text_unset);
    else {
        PyObject *status = PyDict_GetItemWithError(status_names, status_code);
        if (status == NULL && PyErr_Occurred())
            goto done;
        f[F_STATUS] = Py_NewRef(status != NULL ? status : text_unset);
    }
    f[F_ATTRIBUTES] = Py_NewRef(attrs);
    if (opt_cut(&f[F_PEER_ADDR], peer_addr_chars) < 0 || opt_cut(&f[F_REQUEST_ID], request_id_chars) < 0 ||
        opt_cut(&f[F_ROUTE], route_chars) < 0 || opt_cut(&f[F_MODEL], model_chars) < 0 ||
        opt_cut(&f[F_FINISH_REASON], finish_chars) < 0)
        goto done;
    out = new_record(f);
done:
    Py_XDECREF(method);
    for (int i = 0; i < N_FIELDS; i++)
        Py_XDECREF(f[i]);
    return out;
}

/* -- the store's rows (auditor.store.rows.rows_as_tuples of SpanRecords), compiled ------------ */
static PyObject *dumps_fn;          /* rows.dumps_json: the JSON text of what json_flat does not take */
static PyObject *role_values[4];    /* the values of role_engine, role_server, role_client, role_other */
#define FLAT_MAX 256                /* more attributes than normalization keeps go to dumps_fn */

/* The length of text as a JSON string (quotes included), as json.dumps(ensure_ascii=False) writes
 * it: \" \\ \b \f \n \r \t, other characters below 0x20 as \u00XX, the rest as they are. */
static Py_ssize_t
json_text_length(PyObject *text)
{
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t length = PyUnicode_GET_LENGTH(text), out = 2;
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c == '"' || c == '\\' || c == '\b' || c == '\f' || c == '\n' || c == '\r' || c == '\t')
            out += 2;
        else if (c < 0x20)
            out += 6;
        else
            out += 1;
    }
    return out;
}

typedef struct {
    int kind;
    void *data;
    Py_ssize_t at;
} Writer;

static void
put(Writer *w, Py_UCS4 c)
{
    PyUnicode_WRITE(w->kind, w->data, w->at, c);
    w->at++;
}

static void
put_ascii(Writer *w, const char *text)
{
    while (*text)
        put(w, (unsigned char)*text++);
}

static void
put_text(Writer *w, PyObject *text) /* as it is */
{
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    for (Py_ssize_t i = 0; i < PyUnicode_GET_LENGTH(text); i++)
        put(w, PyUnicode_READ(kind, data, i));
}

static void
put_json_text(Writer *w, PyObject *text)
{
    static const char hex[] = "0123456789abcdef";
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    put(w, '"');
    for (Py_ssize_t i = 0; i < PyUnicode_GET_LENGTH(text); i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        switch (c) {
        case '"': put_ascii(w, "\\\""); break;
        case '\\': put_ascii(w, "\\\\"); break;
        case '\b': put_ascii(w, "\\b"); break;
        case '\f': put_ascii(w, "\\f"); break;
        case '\n': put_ascii(w, "\\n"); break;
        case '\r': put_ascii(w, "\\r"); break;
        case '\t': put_ascii(w, "\\t"); break;
        default:
            if (c < 0x20) {
                put_ascii(w, "\\u00");
                put(w, hex[c >> 4]);
                put(w, hex[c & 0xF]);
            }
            else
                put(w, c);
        }
    }
    put(w, '"');
}

/* json.dumps(attrs, ensure_ascii=False, separators=(",", ":")) of a dict of str keys whose values
 * are str, bool, None, int or finite float, as rows.dumps_json writes it; anything else (a list, a
 * dict, NaN) goes to dumps_fn itself. */
static PyObject *
json_flat(PyObject *attrs)
{
    PyObject *numbers[FLAT_MAX] = {NULL}, *key, *value, *out = NULL;
    Py_ssize_t pos = 0, length = 2, n = 0;
    Py_UCS4 maxchar = 127;
    if (PyDict_GET_SIZE(attrs) > FLAT_MAX)
        return PyObject_CallOneArg(dumps_fn, attrs);
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key))
            goto elsewhere;
        length += json_text_length(key) + 1 + (n > 0);
        maxchar = Py_MAX(maxchar, PyUnicode_MAX_CHAR_VALUE(key));
        if (PyUnicode_CheckExact(value)) {
            length += json_text_length(value);
            maxchar = Py_MAX(maxchar, PyUnicode_MAX_CHAR_VALUE(value));
        }
        else if (value == Py_True || value == Py_None)
            length += 4;
        else if (value == Py_False)
            length += 5;
        else if (PyLong_CheckExact(value) ||
                 (PyFloat_CheckExact(value) && isfinite(PyFloat_AS_DOUBLE(value)))) {
            /* int.__repr__ and float.__repr__, as the json encoder calls them */
            if ((numbers[n] = PyObject_Repr(value)) == NULL)
                goto done;
            length += PyUnicode_GET_LENGTH(numbers[n]);
        }
        else
            goto elsewhere;
        n++;
    }
    if ((out = PyUnicode_New(length, maxchar)) == NULL)
        goto done;
    Writer w = {PyUnicode_KIND(out), PyUnicode_DATA(out), 0};
    put(&w, '{');
    pos = 0;
    for (Py_ssize_t i = 0; PyDict_Next(attrs, &pos, &key, &value); i++) {
        if (i > 0)
            put(&w, ',');
        put_json_text(&w, key);
        put(&w, ':');
        if (numbers[i] != NULL)
            put_text(&w, numbers[i]);
        else if (PyUnicode_CheckExact(value))
            put_json_text(&w, value);
        else
            put_ascii(&w, value == Py_True ? "true" : value == Py_False ? "false" : "null");
    }
    put(&w, '}');
    assert(w.at == length);
    goto done;
elsewhere:
    out = PyObject_CallOneArg(dumps_fn, attrs);
done:
    for (Py_ssize_t i = 0; i < FLAT_MAX && i <= n; i++)
        Py_XDECREF(numbers[i]);
    return out;
}

/* rows.rows_as_tuples(records, shape_of(SpanRecord)): each record's fields in order, its role as
 * the role's value and its attributes as JSON text. Records of record_type only. With null (the
 * store's stand-in for NULL, rows.driver_null()), every None is null and a bool its int: values
 * the SQLite driver binds without its adapter lookup, which it makes for any value but an exact
 * int, float, str or bytearray (in these rows: None and bools). */
static PyObject *
span_rows(PyObject *self, PyObject *args)
{
    PyObject *records, *null = Py_None, *seq, *out;
    if (!PyArg_ParseTuple(args, "O|O:span_rows", &records, &null))
        return NULL;
    if (record_type == NULL || dumps_fn == NULL)
        return PyErr_Format(PyExc_RuntimeError, "configure() was not given the record type and dumps");
    if ((seq = PySequence_Fast(records, "records: a sequence")) == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if ((out = PyList_New(count)) == NULL)
        goto fail;
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *record = PySequence_Fast_GET_ITEM(seq, r), *row;
        if (Py_TYPE(record) != record_type) {
            PyErr_Format(PyExc_TypeError, "records: %.100s, not a SpanRecord", Py_TYPE(record)->tp_name);
            goto fail;
        }
        if ((row = PyTuple_New(N_FIELDS)) == NULL)
            goto fail;
        PyList_SET_ITEM(out, r, row);
        for (int i = 0; i < N_FIELDS; i++) {
            PyObject *value = *(PyObject **)((char *)record + field_offsets[i]);
            if (value == NULL) {
                PyErr_Format(PyExc_AttributeError, "a SpanRecord without its %s", field_names[i]);
                goto fail;
            }
            if (i == F_ROLE) {
                PyObject *roles[] = {role_engine, role_server, role_client, role_other};
                PyObject *found = NULL;
                for (int k = 0; k < 4 && found == NULL; k++)
                    if (value == roles[k])
                        found = Py_NewRef(role_values[k]);
                value = found != NULL ? found : value == Py_None ? Py_NewRef(null)
                                                                 : PyObject_GetAttrString(value, "value");
            }
            else if (i == F_ATTRIBUTES)
                value = PyDict_CheckExact(value) ? json_flat(value) : PyObject_CallOneArg(dumps_fn, value);
            else if (null != Py_None && value == Py_None)
                value = Py_NewRef(null);
            else if (null != Py_None && PyBool_Check(value))
                value = PyLong_FromLong(value == Py_True);
            else
                Py_INCREF(value);
            if (value == NULL)
                goto fail;
            PyTuple_SET_ITEM(row, i, value);
        }
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

/* rows.dumps_json(attrs) by json_flat: the same text (tests/test_normalize_compiled.py). */
static PyObject *
attributes_json(PyObject *self, PyObject *attrs)
{
    if (dumps_fn == NULL)
        return PyErr_Format(PyExc_RuntimeError, "configure_rows() was not called");
    return PyDict_CheckExact(attrs) ? json_flat(attrs) : PyObject_CallOneArg(dumps_fn, attrs);
}

static PyObject *
configure_rows(PyObject *self, PyObject *args)
{
    PyObject *dumps, *values;
    if (!PyArg_ParseTuple(args, "OO!:configure_rows", &dumps, &PyTuple_Type, &values))
        return NULL;
    if (!PyCallable_Check(dumps) || PyTuple_GET_SIZE(values) != 4)
        return PyErr_Format(PyExc_TypeError, "configure_rows(dumps, the 4 roles' values)");
    if (record_type == NULL)
        return PyErr_Format(PyExc_RuntimeError, "configure() was not given the record type");
    for (int i = 0; i < 4; i++)
        Py_XSETREF(role_values[i], Py_NewRef(PyTuple_GET_ITEM(values, i)));
    Py_XSETREF(dumps_fn, Py_NewRef(dumps));
    Py_RETURN_NONE;
}

/* -- set-up ---------------------------------------------------------------------------------------- */
static int
texts_of(PyObject *tuple, Py_ssize_t size, const char *what)
{
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != size) {
        PyErr_Format(PyExc_ValueError, "%s: a tuple of %zd", what, size);
        return -1;
    }
    return 0;
}

static int
all_texts(PyObject *tuple, const char *what)
{
    if (!PyTuple_Check(tuple)) {
        PyErr_Format(PyExc_TypeError, "%s: a tuple of keys", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++)
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(tuple, i))) {
            PyErr_Format(PyExc_TypeError, "%s: a key that is not a str", what);
            return -1;
        }
    return 0;
}

/* Where the record type keeps each field: one writable object slot of its own each, else an
 * error (configure() then fails, and the Python builder builds). */
static int
record_slots(PyObject *record, Py_ssize_t *offsets)
{
    if (!PyType_Check(record)) {
        PyErr_SetString(PyExc_TypeError, "record: a type");
        return -1;
    }
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *descr = PyObject_GetAttrString(record, field_names[i]);
        if (descr == NULL)
            return -1;
        int slot = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                   ((PyDescrObject *)descr)->d_type == (PyTypeObject *)record;
        PyMemberDef *member = slot ? ((PyMemberDescrObject *)descr)->d_member : NULL;
        Py_DECREF(descr);
        if (member == NULL || member->type != T_OBJECT_EX || (member->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "record: %s is not an object slot of its own", field_names[i]);
            return -1;
        }
        offsets[i] = member->offset;
    }
    return 0;
}

static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *functions, *names, *roles, *texts, *widths, *keys, *single, *genai, *fields, *record = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!O!|O:configure", &PyTuple_Type, &functions, &PyTuple_Type, &names,
                          &PyTuple_Type, &roles, &PyTuple_Type, &texts, &PyTuple_Type, &widths, &PyTuple_Type,
                          &keys, &PyTuple_Type, &single, &PyFrozenSet_Type, &genai, &PyTuple_Type, &fields, &record))
        return NULL;
    if (texts_of(fields, N_FIELDS, "fields") < 0)
        return NULL;
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *field = PyTuple_GET_ITEM(fields, i);
        if (!PyUnicode_Check(field) || PyUnicode_CompareWithASCIIString(field, field_names[i]) != 0)
            return PyErr_Format(PyExc_ValueError, "fields: %R where this builder has %s", field, field_names[i]);
    }
    Py_ssize_t offsets[N_FIELDS];
    if (record != Py_None && record_slots(record, offsets) < 0)
        return NULL;
    if (texts_of(functions, 7, "functions") < 0 || texts_of(names, 2, "names") < 0 || texts_of(roles, 4, "roles") < 0 ||
        texts_of(texts, 4, "texts") < 0 || texts_of(keys, N_KEY_TUPLES, "keys") < 0 ||
        texts_of(single, N_SINGLE_KEYS, "single keys") < 0 || all_texts(single, "single keys") < 0 ||
        all_texts(texts, "texts") < 0)
        return NULL;
    for (int i = 0; i < N_KEY_TUPLES; i++)
        if (all_texts(PyTuple_GET_ITEM(keys, i), "keys") < 0)
            return NULL;
    for (int i = 0; i < 7; i++)
        if (!PyCallable_Check(PyTuple_GET_ITEM(functions, i)))
            return PyErr_Format(PyExc_TypeError, "functions: item %d is not callable", i);
    if (!PyDict_Check(PyTuple_GET_ITEM(names, 0)) || !PyDict_Check(PyTuple_GET_ITEM(names, 1)))
        return PyErr_Format(PyExc_TypeError, "names: the kind and status names' dicts");
    if (!PyArg_ParseTuple(widths, "nnnnnn:widths", &name_chars, &peer_addr_chars, &request_id_chars, &route_chars,
                          &model_chars, &finish_chars))
        return NULL;
    PyObject **function_slots[] = {&new_span_fn, &engine_fn, &hostport_fn, &cut_fn, &as_int_fn, &as_float_fn,
                                   &as_finish_fn};
    for (int i = 0; i < 7; i++)
        Py_XSETREF(*function_slots[i], Py_NewRef(PyTuple_GET_ITEM(functions, i)));
    Py_XSETREF(kind_names, Py_NewRef(PyTuple_GET_ITEM(names, 0)));
    Py_XSETREF(status_names, Py_NewRef(PyTuple_GET_ITEM(names, 1)));
    PyObject **role_slots[] = {&role_engine, &role_server, &role_client, &role_other};
    for (int i = 0; i < 4; i++)
        Py_XSETREF(*role_slots[i], Py_NewRef(PyTuple_GET_ITEM(roles, i)));
    PyObject **text_slots[] = {&text_unset, &text_unspecified, &text_empty, &dropped_key};
    for (int i = 0; i < 4; i++)
        Py_XSETREF(*text_slots[i], Py_NewRef(PyTuple_GET_ITEM(texts, i)));
    for (int i = 0; i < N_KEY_TUPLES; i++)
        Py_XSETREF(key_tuples[i], Py_NewRef(PyTuple_GET_ITEM(keys, i)));
    for (int i = 0; i < N_SINGLE_KEYS; i++)
        Py_XSETREF(single_keys[i], Py_NewRef(PyTuple_GET_ITEM(single, i)));
    Py_XSETREF(genai_keys, Py_NewRef(genai));
    Py_XSETREF(record_type, record == Py_None ? NULL : (PyTypeObject *)Py_NewRef(record));
    memcpy(field_offsets, offsets, sizeof field_offsets);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(functions, names, roles, texts, widths, keys, single_keys, genai_keys, fields[, record]): "
     "the rules' data, from collectors.normalize; with record, its slots are filled directly."},
    {"build_span", (PyCFunction)(void (*)(void))build_span, METH_FASTCALL,
     "build_span(head, name, kind_code, status_code, attrs, dropped, service, host, process_pid) -> SpanRecord;"
     " as normalize.build_span."},
    {"configure_rows", configure_rows, METH_VARARGS,
     "configure_rows(dumps, role_values): rows.dumps_json and the roles' values, after configure()."},
    {"span_rows", span_rows, METH_VARARGS,
     "span_rows(records[, null]) -> [row tuple]; as rows.rows_as_tuples of SpanRecords, with null for None."},
    {"attributes_json", attributes_json, METH_O, "attributes_json(attrs) -> str; as rows.dumps_json."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_normalize",
    .m_doc = "The compiled twin of collectors.normalize.build_span.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__normalize(void)
{
    return PyModule_Create(&module);
}
