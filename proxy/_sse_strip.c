/* The byte strip of proxy/relay.py in one C pass: the relay's per-response hot path.
 *
 * `strip_events(block, chat, logprobs, token_ids, usage_added)` applies to a block of whole
 * one-line `data: <json>` events exactly the rules of relay.py's Python block path
 * (`_cut_additions`, `_additions_gone` and the per-event visibility check of `strip_sse`), and
 * returns the client's bytes with the payloads of the events holding `"usage":{` (left out of
 * the bytes when `usage_added`: the proxy asked for them), or None whenever those rules cannot
 * prove the cut (the caller then goes event by event, parsing). The caller parses the usage
 * payloads and checks them (`_take_usage_events`' rules).
 * `strip_whole(data, logprobs, token_ids)` does the same for a non-streamed response (the
 * rules of `strip_bytes(..., whole=True)`).
 *
 * Why C: the Python path makes some forty calls of `bytes.find`/`count`/slicing per event,
 * ~5 us warm and ~9 us after each wake-up of the event loop; with a model server streaming
 * one token per read, that was most of what capture cost the proxy process
 * (docs/perf/proxy.md). No JSON library edits a document without decoding and re-encoding
 * it, which costs more. This pass reads each event once and writes the result once.
 *
 * Untrusted input: every read stays inside [start, end) of the caller's buffer and every
 * write is checked against the output's capacity; anything unexpected returns None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* A byte pattern and its anchor: the offset of a byte in it that is rare where the pattern
 * is looked for (`{`, the `x` of `index`), which `find` looks for with memchr. Each other
 * occurrence of the anchor byte costs a memchr and a memcmp. The ends of the added logprobs
 * object and the token-id arrays are looked for across the logprobs object, where every
 * token's entry holds a `}` and two `[` (`"bytes":[`, `"top_logprobs":[`) but no `f` or `d`
 * outside its token's own text: anchored on those, the bench's 16-token answer took ~60
 * fewer memchr/memcmp pairs to strip (callgrind), and a long answer saves a pair per `}`
 * and `[` of each token. */
typedef struct {
    const char *s;
    size_t n;
    size_t anchor;
} Pattern;

#define PATTERN(literal) {literal, sizeof(literal) - 1, 0}
#define ANCHORED(literal, anchor) {literal, sizeof(literal) - 1, anchor}

static const Pattern LOGPROBS_KEY = ANCHORED(",\"logprobs\":{", 12);
static const Pattern LOGPROBS_END = ANCHORED("},\"finish_reason\":", 3); /* the f */
static const Pattern LOGPROBS_NULL = PATTERN(",\"logprobs\":null");
static const Pattern IDS_KEY = ANCHORED("token_ids\":[", 7); /* the d */
static const Pattern IDS_BEFORE = PATTERN(",\"");
static const Pattern PROMPT_IDS_BEFORE = PATTERN(",\"prompt_");
static const Pattern INDEX_KEY = ANCHORED("\"index\":", 5);
static const Pattern OBJECT_THEN_KEY = PATTERN("},\""); /* a nested object's end, then a key */
static const Pattern FINISHED = PATTERN("\"finish_reason\":\"");
static const Pattern CHAT_TEXT = PATTERN("\"delta\":{\"content\":\"");
static const Pattern CHAT_EMPTY_TEXT = PATTERN("\"delta\":{\"content\":\"\"");
static const Pattern COMPLETION_TEXT = PATTERN("\"text\":\"");
static const Pattern COMPLETION_EMPTY_TEXT = PATTERN("\"text\":\"\"");
static const Pattern NO_CHOICES = PATTERN("\"choices\":[]");
static const Pattern TOOL_CALLS = PATTERN("\"delta\":{\"tool_calls\":[{");
static const Pattern ROLE = PATTERN("\"delta\":{\"role\":\"");
static const Pattern EMPTY_ROLE = PATTERN("\"delta\":{\"role\":\"\"");
static const Pattern DONE_LINE = PATTERN("data: [DONE]");
static const Pattern DATA_PREFIX = PATTERN("data: ");
static const Pattern USAGE_KEY = PATTERN("\"usage\":{");

/* First occurrence of `p` in [from, end), or NULL: memmem's answer. Every occurrence holds
 * the anchor byte at `p.anchor`, so checking each anchor byte from `from + p.anchor` on finds
 * them all, in order. Why not memmem: glibc's sets up a shift table on every call, and the
 * relay makes several calls per event on ~300-byte events; it was the strip's largest cost
 * in a profile of the serving proxy (6.8 of its ~13 us per streamed answer). */
static const char *find(const char *from, const char *end, Pattern p) {
    if (from >= end || (size_t)(end - from) < p.n) {
        return NULL;
    }
    const char *last = end - p.n; /* the last place an occurrence can start */
    const char *at = from;
    while (at <= last) {
        const char *hit = memchr(at + p.anchor, p.s[p.anchor], (size_t)(last - at) + 1);
        if (hit == NULL) {
            return NULL;
        }
        const char *candidate = hit - p.anchor;
        if (memcmp(candidate, p.s, p.n) == 0) {
            return candidate;
        }
        at = candidate + 1;
    }
    return NULL;
}

static int contains(const char *from, const char *end, Pattern p) {
    return find(from, end, p) != NULL;
}

static int starts_with(const char *at, const char *end, Pattern p) {
    return (size_t)(end - at) >= p.n && memcmp(at, p.s, p.n) == 0;
}

/* [line, at) ends with `p`. */
static int preceded_by(const char *at, const char *line, Pattern p) {
    return (size_t)(at - line) >= p.n && memcmp(at - p.n, p.s, p.n) == 0;
}

/* Output buffer with a fixed capacity; `ok` turns 0 on overflow and stays 0. */
typedef struct {
    char *at;
    char *end;
    int ok;
} Out;

static void put(Out *out, const char *from, size_t n) {
    if (!out->ok || (size_t)(out->end - out->at) < n) {
        out->ok = 0;
        return;
    }
    memcpy(out->at, from, n);
    out->at += n;
}

/* `_cut_additions` for one event line or one whole response [line, end): each added logprobs
 * object and token-id array becomes null, in document order. 0 when a cut is not provable. */
static int cut_line(const char *line, const char *end, Out *out, int logprobs, int token_ids) {
    const char *done = line;
    const char *lp_at = logprobs ? find(line, end, LOGPROBS_KEY) : NULL;
    const char *id_at = token_ids ? find(line, end, IDS_KEY) : NULL;
    while (lp_at != NULL || id_at != NULL) {
        if (lp_at != NULL && (id_at == NULL || lp_at < id_at)) {
            /* The object ends at the first `},"finish_reason":` of the same choice. */
            const char *stop = find(lp_at, end, LOGPROBS_END);
            /* ...and holds no `},"` before it: vLLM's logprobs value never does, while a
             * field after it (`"logprobs":{...},"extra":{...},"finish_reason"`) would have
             * gone with the cut. */
            if (stop == NULL || contains(lp_at, stop, INDEX_KEY) ||
                contains(lp_at, stop, OBJECT_THEN_KEY) ||
                memchr(lp_at, '\n', (size_t)(stop - lp_at)) != NULL) {
                return 0;
            }
            put(out, done, (size_t)(lp_at - done));
            put(out, LOGPROBS_NULL.s, LOGPROBS_NULL.n);
            done = stop + 1;
            lp_at = find(done, end, LOGPROBS_KEY);
            if (id_at != NULL && id_at < done) {
                id_at = find(done, end, IDS_KEY);
            }
            continue;
        }
        /* `,"token_ids":[` or `,"prompt_token_ids":[`, holding digits and commas only. */
        if (!preceded_by(id_at, line, IDS_BEFORE) && !preceded_by(id_at, line, PROMPT_IDS_BEFORE)) {
            return 0;
        }
        const char *body = id_at + IDS_KEY.n;
        const char *q = body;
        while (q < end && ((*q >= '0' && *q <= '9') || *q == ',')) {
            q++;
        }
        if (q >= end || *q != ']') {
            return 0;
        }
        put(out, done, (size_t)(body - 1 - done));
        put(out, "null", 4);
        done = q + 1;
        id_at = find(done, end, IDS_KEY);
    }
    put(out, done, (size_t)(end - done));
    return out->ok;
}

/* What `_additions_gone`, the per-event visibility check and the usage check read from one
 * event (or one whole response) [from, to): every occurrence of their patterns, found in one
 * walk over its quote characters. Each pattern starts or ends with a `"`, so visiting every
 * `"` finds every occurrence that `find`/`count` would; the counted patterns cannot overlap
 * themselves, so the counts equal `count`'s. This walk replaced some twelve memmem scans per
 * event. The quotes are found 16 bytes at a time (SSE2, which every x86-64 has): a compare and
 * a bit mask, then one step per quote; the last 15 bytes, and every byte where SSE2 is
 * missing, by hopping from quote to quote with memchr. That hop, a call per quote (about a
 * quarter of a compact JSON event's bytes are quotes), was the walk before: the bench's
 * 19-event block took ~72k instructions to strip with it and takes ~61k (callgrind). A byte
 * loop, mispredicting its branch at each quote, was slower than the memchr hop. */
typedef struct {
    Py_ssize_t logprobs_any, logprobs_nulled, ids_any, ids_nulled;
    int finished, text, empty_text, no_choices, tool_calls, role, empty_role, usage;
} Facts;

static int at_pattern(const char *at, const char *to, Pattern p) {
    return (size_t)(to - at) >= p.n && memcmp(at, p.s, p.n) == 0;
}

/* The patterns at one quote `q` of [from, to). Inlined in both of read_facts' loops: as a
 * call (gcc's choice at -O2) it cost 4k instructions more per 19-event block. */
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline void read_quote(const char *q, const char *from, const char *to, int chat,
                              Facts *facts) {
    static const Pattern NULL_VALUE = PATTERN(":null");
    static const Pattern DELTA = PATTERN("\"delta\":{");
    /* Patterns ending at this quote: `logprobs"` and `_ids"`, maybe followed by `:null`
     * (both end in `s`: most quotes are passed over on that one byte). */
    if (q > from && q[-1] == 's') {
        if ((size_t)(q - from) >= 8 && memcmp(q - 8, "logprobs", 8) == 0) {
            facts->logprobs_any++;
            facts->logprobs_nulled += at_pattern(q + 1, to, NULL_VALUE);
        } else if ((size_t)(q - from) >= 4 && memcmp(q - 4, "_ids", 4) == 0) {
            facts->ids_any++;
            facts->ids_nulled += at_pattern(q + 1, to, NULL_VALUE);
        }
    }
    /* Patterns starting at it. */
    switch (q + 1 < to ? q[1] : 0) {
    case 'f':
        facts->finished |= at_pattern(q, to, FINISHED);
        break;
    case 'c':
        facts->no_choices |= at_pattern(q, to, NO_CHOICES);
        break;
    case 'u':
        facts->usage |= at_pattern(q, to, USAGE_KEY);
        break;
    case 'd':
        if (chat && at_pattern(q, to, DELTA)) {
            facts->text |= at_pattern(q, to, CHAT_TEXT);
            facts->empty_text |= at_pattern(q, to, CHAT_EMPTY_TEXT);
            facts->tool_calls |= at_pattern(q, to, TOOL_CALLS);
            facts->role |= at_pattern(q, to, ROLE);
            facts->empty_role |= at_pattern(q, to, EMPTY_ROLE);
        }
        break;
    case 't':
        if (!chat) {
            facts->text |= at_pattern(q, to, COMPLETION_TEXT);
            facts->empty_text |= at_pattern(q, to, COMPLETION_EMPTY_TEXT);
        }
        break;
    default:
        break;
    }
}

static void read_facts(const char *from, const char *to, int chat, Facts *facts) {
    *facts = (Facts){0};
    const char *at = from;
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"');
    for (; to - at >= 16; at += 16) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)at);
        unsigned mask = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, quote));
        while (mask != 0) {
            read_quote(at + __builtin_ctz(mask), from, to, chat, facts);
            mask &= mask - 1; /* the next quote */
        }
    }
#endif
    for (const char *q = memchr(at, '"', (size_t)(to - at)); q != NULL;
         q = q + 1 < to ? memchr(q + 1, '"', (size_t)(to - q - 1)) : NULL) {
        read_quote(q, from, to, chat, facts);
    }
}

/* `_additions_gone`: every key the proxy added is now null. */
static int additions_gone(const Facts *facts, int logprobs, int token_ids) {
    return (!logprobs || facts->logprobs_any == facts->logprobs_nulled) &&
           (!token_ids || facts->ids_any == facts->ids_nulled);
}

/* A new output of `len + len / 4 + 16` bytes: a cut replaces at least 14 bytes
 * (`,"logprobs":{}` or `token_ids":[]`) and writes at most 2 more than it removes, so
 * len + len / 7 always fits; `put` checks anyway. NULL (an exception set) on no memory. */
static PyObject *new_output(Py_ssize_t len, Out *out) {
    Py_ssize_t capacity = len + len / 4 + 16;
    PyObject *result = PyBytes_FromStringAndSize(NULL, capacity);
    if (result != NULL) {
        char *first = PyBytes_AS_STRING(result);
        *out = (Out){first, first + capacity, 1};
    }
    return result;
}

/* The written part of `result`, or None when the cut was not provable. */
static PyObject *finish_output(PyObject *result, const Out *out, int provable) {
    if (!provable || !out->ok) {
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&result, out->at - PyBytes_AS_STRING(result)) < 0) {
        return NULL;
    }
    return result;
}

/* The per-event check of `strip_sse`: the event keeps something the client sees. */
static int visible(const char *line, const char *end, int chat, const Facts *facts) {
    if (facts->finished) {
        return 1;
    }
    if (facts->text && !facts->empty_text) {
        return 1;
    }
    if ((size_t)(end - line) == DONE_LINE.n && memcmp(line, DONE_LINE.s, DONE_LINE.n) == 0) {
        return 1;
    }
    if (facts->no_choices) {
        return 1;
    }
    return chat && (facts->tool_calls || (facts->role && !facts->empty_role));
}

static PyObject *strip_events(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer block;
    int chat, logprobs, token_ids, usage_added;
    if (!PyArg_ParseTuple(args, "y*pppp:strip_events", &block, &chat, &logprobs, &token_ids,
                          &usage_added)) {
        return NULL;
    }
    const char *start = block.buf;
    const char *end = start + block.len;
    Out out;
    PyObject *usage_events = PyList_New(0);
    PyObject *result = usage_events == NULL ? NULL : new_output(block.len, &out);
    if (result == NULL) {
        Py_XDECREF(usage_events);
        PyBuffer_Release(&block);
        return NULL;
    }
    int provable = block.len > 0;
    const char *line = start;
    while (provable && line < end) {
        /* The event ends at its first newline, which must be the first of a blank line. */
        const char *line_end = memchr(line, '\n', (size_t)(end - line));
        if (line_end == NULL || line_end + 1 >= end || line_end[1] != '\n' ||
            !starts_with(line, line_end, DATA_PREFIX) ||
            memchr(line, '\r', (size_t)(line_end - line)) != NULL) {
            provable = 0; /* not whole one-line events */
            break;
        }
        char *cut = out.at;
        if (!cut_line(line, line_end, &out, logprobs, token_ids)) {
            provable = 0;
            break;
        }
        const char *cut_end = out.at;
        Facts facts;
        read_facts(cut, cut_end, chat, &facts);
        provable = additions_gone(&facts, logprobs, token_ids) &&
                   visible(cut, cut_end, chat, &facts);
        if (provable && facts.usage) {
            /* The caller parses a usage event and checks it; one the proxy asked for on its
             * own never reaches the client. */
            PyObject *payload = PyBytes_FromStringAndSize(cut + DATA_PREFIX.n,
                                                          cut_end - cut - DATA_PREFIX.n);
            if (payload == NULL || PyList_Append(usage_events, payload) < 0) {
                Py_XDECREF(payload);
                Py_DECREF(usage_events);
                Py_DECREF(result);
                PyBuffer_Release(&block);
                return NULL;
            }
            Py_DECREF(payload);
            if (usage_added) {
                out.at = cut;
                line = line_end + 2;
                continue;
            }
        }
        put(&out, "\n\n", 2);
        provable = provable && out.ok;
        line = line_end + 2;
    }
    PyBuffer_Release(&block);
    PyObject *stripped = finish_output(result, &out, provable);
    if (stripped == NULL || stripped == Py_None) {
        Py_DECREF(usage_events);
        return stripped;
    }
    PyObject *pair = PyTuple_Pack(2, stripped, usage_events);
    Py_DECREF(stripped);
    Py_DECREF(usage_events);
    return pair;
}

/* `strip_bytes(plan, data, whole=True)`: a non-streamed response, cut and checked like one
 * event line but never dropped (its choices are the answer, however empty). */
static PyObject *strip_whole(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer data;
    int logprobs, token_ids;
    if (!PyArg_ParseTuple(args, "y*pp:strip_whole", &data, &logprobs, &token_ids)) {
        return NULL;
    }
    const char *start = data.buf;
    const char *end = start + data.len;
    Out out;
    PyObject *result = new_output(data.len, &out);
    if (result == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *first = out.at;
    int provable = cut_line(start, end, &out, logprobs, token_ids);
    if (provable) {
        Facts facts;
        read_facts(first, out.at, 1, &facts);
        provable = additions_gone(&facts, logprobs, token_ids);
    }
    PyBuffer_Release(&data);
    return finish_output(result, &out, provable);
}

static PyMethodDef methods[] = {
    {"strip_events", strip_events, METH_VARARGS,
     "strip_events(block, chat, logprobs, token_ids, usage_added) -> (bytes, [usage event]) | "
     "None: relay.py's block strip."},
    {"strip_whole", strip_whole, METH_VARARGS,
     "strip_whole(data, logprobs, token_ids) -> bytes | None: relay.py's whole-response strip."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "proxy._sse_strip",
    .m_doc = "relay.py's SSE strip in one C pass.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__sse_strip(void) {
    return PyModule_Create(&module);
}
