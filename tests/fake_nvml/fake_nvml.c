/*
 * A stand-in libnvidia-ml.so.1 for tests on machines without NVIDIA GPUs.
 *
 * It exports the handful of NVML entry points that pynvml resolves for the
 * GPU snapshot of slurm_hooks/gpu.py, with the prototypes of the real nvml.h.
 * What it reports comes from a JSON file named by $RECOVERY_FAKE_NVML_STATE,
 * read at every first nvmlInit (the one that takes the reference count from 0
 * to 1), in the shape tools/recovery_devtools/devcluster/config.py fake_gpus() writes:
 *
 *   {"node": "...", "nvml_error": "driver_not_loaded",       (optional)
 *    "gpus": [{"index": 0, "uuid": "GPU-...", "name": "...",
 *              "pci_bus_id": "00000000:18:00.0", "temperature_c": 35,
 *              "ecc_volatile_uncorrected": 0, "ecc_aggregate_uncorrected": 0,
 *              "retired_pages_pending": false, "remapped_rows_pending": false,
 *              "remapped_rows_failure": false, "throttle_reasons": 0,
 *              "nvlink_active": [true, ...], "missing": false,
 *              "ecc_volatile_corrected": 0, "ecc_aggregate_corrected": 0,
 *              "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0,
 *              "retired_pages_sbe": 0, "retired_pages_dbe": 0,
 *              "nvlink_replay": [0, ...], "nvlink_recovery": [0, ...],
 *              "nvlink_crc_flit": [0, ...], "nvlink_crc_data": [0, ...],
 *              "nvlink_ecc_data": [0, ...],
 *              "not_supported": ["ecc", "remapped_rows", ...]}]}
 *
 * The nvlink_<counter> arrays hold one value per link (missing entries are 0).
 * "not_supported" names the features this GPU or driver lacks; each of their
 * calls answers NVML_ERROR_NOT_SUPPORTED, as NVML does on older GPUs (row
 * remapping before Ampere, page retirement from Ampere on, ECC on boards
 * without it): "ecc", "remapped_rows", "retired_pages", "nvlink_errors",
 * "clock_reasons".
 *
 * Outcomes of nvmlInit:
 *   variable unset or file unreadable   NVML_ERROR_DRIVER_NOT_LOADED
 *   file is not valid JSON of that shape NVML_ERROR_UNKNOWN
 *   "nvml_error": "<name>"              NVML_ERROR_<NAME> (unknown name: UNKNOWN)
 * A GPU with "missing": true gets a handle, but every call on that handle
 * answers NVML_ERROR_GPU_IS_LOST. Unknown keys are skipped; known keys must
 * have the right type.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nvml.h>

#define FAKE_MAX_GPUS      64
#define FAKE_MAX_FILE      (4 << 20)
#define FAKE_MAX_DEPTH     64
#define FAKE_DRIVER        "fake-555.42"
#define FAKE_PCI_DEVICE_ID 0x233010DEu   /* H100 SXM5 */
#define FAKE_PCI_SUBSYS_ID 0x16C110DEu
#define FAKE_MEMORY_BYTES  (80ULL << 30)

/* the header only forward-declares this; a handle points into g_gpus */
struct nvmlDevice_st {
    unsigned int index;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char bus_id_text[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int pci_domain, pci_bus, pci_device, pci_function;
    unsigned int temperature_c;
    unsigned long long ecc_volatile_uncorrected;
    unsigned long long ecc_aggregate_uncorrected;
    int retired_pages_pending;
    int remapped_rows_pending;
    int remapped_rows_failure;
    unsigned long long throttle_reasons;
    unsigned int nvlink_count;
    int nvlink_active[NVML_NVLINK_MAX_LINKS];
    int missing;
    unsigned long long ecc_volatile_corrected;
    unsigned long long ecc_aggregate_corrected;
    unsigned int remapped_rows_correctable;
    unsigned int remapped_rows_uncorrectable;
    unsigned int retired_pages[NVML_PAGE_RETIREMENT_CAUSE_COUNT];
    unsigned long long nvlink_errors[NVML_NVLINK_MAX_LINKS][NVML_NVLINK_ERROR_COUNT];
    unsigned int not_supported;   /* FAKE_NS_* bits */
};

#define FAKE_NS_ECC           0x01u
#define FAKE_NS_REMAPPED_ROWS 0x02u
#define FAKE_NS_RETIRED_PAGES 0x04u
#define FAKE_NS_NVLINK_ERRORS 0x08u
#define FAKE_NS_CLOCK_REASONS 0x10u
#define FAKE_MAX_RETIRED      4096u   /* per cause; real boards retire far fewer */

struct fake_state {
    unsigned int count;
    nvmlReturn_t init_error;
    struct nvmlDevice_st gpus[FAKE_MAX_GPUS];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_refcount;
static struct fake_state g_state;

/* ------------------------------------------------------------------------ */
/* JSON reading: a cursor over a NUL-terminated buffer; every reader returns
 * 0 on success and -1 on malformed input, and never reads past `end`. */

struct cursor {
    const char *p;
    const char *end;
    int depth;
};

static void skip_ws(struct cursor *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int peek(struct cursor *c)
{
    skip_ws(c);
    return c->p < c->end ? (unsigned char)*c->p : -1;
}

static int expect(struct cursor *c, char ch)
{
    if (peek(c) != (unsigned char)ch)
        return -1;
    c->p++;
    return 0;
}

static int hex4(const char *s, unsigned int *out)
{
    unsigned int v = 0;
    for (int i = 0; i < 4; i++) {
        char ch = s[i];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= (unsigned int)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') v |= (unsigned int)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') v |= (unsigned int)(ch - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

/* Append one code point as UTF-8; out == NULL only validates. */
static int put_utf8(char *out, size_t cap, size_t *len, unsigned int cp)
{
    char buf[4];
    size_t n;
    if (cp == 0)
        return -1;   /* no embedded NULs in C strings */
    if (cp < 0x80) { buf[0] = (char)cp; n = 1; }
    else if (cp < 0x800) {
        buf[0] = (char)(0xC0 | (cp >> 6)); buf[1] = (char)(0x80 | (cp & 0x3F)); n = 2;
    } else if (cp < 0x10000) {
        buf[0] = (char)(0xE0 | (cp >> 12)); buf[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[2] = (char)(0x80 | (cp & 0x3F)); n = 3;
    } else {
        buf[0] = (char)(0xF0 | (cp >> 18)); buf[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        buf[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); buf[3] = (char)(0x80 | (cp & 0x3F)); n = 4;
    }
    if (out) {
        if (*len + n >= cap)
            return -1;   /* longer than the field it is meant for */
        memcpy(out + *len, buf, n);
    }
    *len += n;
    return 0;
}

/* A JSON string into out[cap] (NUL-terminated); out == NULL skips it. */
static int read_string(struct cursor *c, char *out, size_t cap)
{
    size_t len = 0;
    if (expect(c, '"'))
        return -1;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p++;
        if (ch == '"') {
            if (out)
                out[len] = '\0';
            return 0;
        }
        if (ch < 0x20)
            return -1;
        if (ch != '\\') {
            if (out) {
                if (len + 1 >= cap)
                    return -1;
                out[len] = (char)ch;
            }
            len++;
            continue;
        }
        if (c->p >= c->end)
            return -1;
        ch = (unsigned char)*c->p++;
        unsigned int cp;
        switch (ch) {
        case '"': cp = '"'; break;
        case '\\': cp = '\\'; break;
        case '/': cp = '/'; break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u':
            if (c->end - c->p < 4 || hex4(c->p, &cp))
                return -1;
            c->p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {   /* high surrogate: needs its pair */
                unsigned int lo;
                if (c->end - c->p < 6 || c->p[0] != '\\' || c->p[1] != 'u' ||
                    hex4(c->p + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                    return -1;
                c->p += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return -1;
            }
            break;
        default:
            return -1;
        }
        if (put_utf8(out, cap, &len, cp))
            return -1;
    }
    return -1;   /* unterminated */
}

/* A JSON number. Integers are kept exactly (saturating at ULLONG_MAX);
 * fractions and exponents are accepted and truncated toward zero. */
struct number {
    int negative;
    unsigned long long value;
};

static int read_number(struct cursor *c, struct number *n)
{
    const char *start;
    int fraction = 0;
    skip_ws(c);
    start = c->p;
    n->negative = 0;
    n->value = 0;
    if (c->p < c->end && *c->p == '-') {
        n->negative = 1;
        c->p++;
    }
    if (c->p >= c->end || *c->p < '0' || *c->p > '9')
        return -1;
    if (*c->p == '0') {
        c->p++;
    } else {
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
            unsigned int digit = (unsigned int)(*c->p - '0');
            if (n->value > (~0ULL - digit) / 10)
                n->value = ~0ULL;
            else
                n->value = n->value * 10 + digit;
            c->p++;
        }
    }
    if (c->p < c->end && *c->p == '.') {
        c->p++;
        if (c->p >= c->end || *c->p < '0' || *c->p > '9')
            return -1;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9')
            c->p++;
        fraction = 1;
    }
    if (c->p < c->end && (*c->p == 'e' || *c->p == 'E')) {
        c->p++;
        if (c->p < c->end && (*c->p == '+' || *c->p == '-'))
            c->p++;
        if (c->p >= c->end || *c->p < '0' || *c->p > '9')
            return -1;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9')
            c->p++;
        fraction = 1;
    }
    if (fraction) {   /* the grammar is checked; let strtod work out the value */
        char tmp[64];
        size_t len = (size_t)(c->p - start);
        double d;
        if (len >= sizeof tmp)
            return -1;
        memcpy(tmp, start, len);
        tmp[len] = '\0';
        d = strtod(tmp, NULL);
        n->negative = d < 0;
        if (n->negative)
            d = -d;
        n->value = d >= 18446744073709551615.0 ? ~0ULL : (unsigned long long)d;
    }
    return 0;
}

static int read_literal(struct cursor *c, const char *word)
{
    size_t len = strlen(word);
    skip_ws(c);
    if ((size_t)(c->end - c->p) < len || memcmp(c->p, word, len) != 0)
        return -1;
    c->p += len;
    return 0;
}

static int skip_value(struct cursor *c);

static int skip_container(struct cursor *c, char open, char close)
{
    if (++c->depth > FAKE_MAX_DEPTH || expect(c, open))
        return -1;
    if (peek(c) == (unsigned char)close) {
        c->p++;
        c->depth--;
        return 0;
    }
    for (;;) {
        if (open == '{' && (read_string(c, NULL, 0) || expect(c, ':')))
            return -1;
        if (skip_value(c))
            return -1;
        if (peek(c) == ',') {
            c->p++;
            continue;
        }
        if (expect(c, close))
            return -1;
        c->depth--;
        return 0;
    }
}

static int skip_value(struct cursor *c)
{
    struct number n;
    switch (peek(c)) {
    case '"': return read_string(c, NULL, 0);
    case '{': return skip_container(c, '{', '}');
    case '[': return skip_container(c, '[', ']');
    case 't': return read_literal(c, "true");
    case 'f': return read_literal(c, "false");
    case 'n': return read_literal(c, "null");
    default: return read_number(c, &n);
    }
}

static int read_bool(struct cursor *c, int *out)
{
    if (peek(c) == 't') {
        *out = 1;
        return read_literal(c, "true");
    }
    if (peek(c) == 'f') {
        *out = 0;
        return read_literal(c, "false");
    }
    return -1;
}

static int read_unsigned(struct cursor *c, unsigned long long max, unsigned long long *out)
{
    struct number n;
    if (read_number(c, &n) || (n.negative && n.value != 0))
        return -1;
    *out = n.value > max ? max : n.value;
    return 0;
}

/* Walk the members of an object, calling member() for each key. */
typedef int (*member_fn)(struct cursor *c, const char *key, void *ctx);

static int read_object(struct cursor *c, member_fn member, void *ctx)
{
    char key[64];
    if (++c->depth > FAKE_MAX_DEPTH || expect(c, '{'))
        return -1;
    if (peek(c) == '}') {
        c->p++;
        c->depth--;
        return 0;
    }
    for (;;) {
        const char *key_start;
        skip_ws(c);
        key_start = c->p;
        if (read_string(c, key, sizeof key)) {
            /* a key too long to be one of ours: skip it and its value */
            c->p = key_start;
            if (read_string(c, NULL, 0) || expect(c, ':') || skip_value(c))
                return -1;
        } else if (expect(c, ':') || member(c, key, ctx)) {
            return -1;
        }
        if (peek(c) == ',') {
            c->p++;
            continue;
        }
        if (expect(c, '}'))
            return -1;
        c->depth--;
        return 0;
    }
}

/* Up to `max_digits` hex digits ending at `stop`; advances *s past `stop`. */
static int hex_field(const char **s, int max_digits, char stop, unsigned int *out)
{
    unsigned int v = 0;
    int digits = 0;
    for (; **s && **s != stop; (*s)++, digits++) {
        char ch = **s;
        if (digits == max_digits)
            return -1;
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= (unsigned int)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') v |= (unsigned int)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') v |= (unsigned int)(ch - 'A' + 10);
        else return -1;
    }
    if (digits == 0 || **s != stop)
        return -1;
    if (stop)
        (*s)++;
    *out = v;
    return 0;
}

/* "00000000:18:00.0" (or the 4-digit-domain "0000:18:00.0") into its parts */
static int parse_bus_id(struct nvmlDevice_st *g)
{
    const char *s = g->bus_id_text;
    unsigned int dom, bus, dev, fn;
    if (hex_field(&s, 8, ':', &dom) || hex_field(&s, 2, ':', &bus) ||
        hex_field(&s, 2, '.', &dev) || hex_field(&s, 1, '\0', &fn) || dev > 0x1F || fn > 7)
        return -1;
    g->pci_domain = dom;
    g->pci_bus = bus;
    g->pci_device = dev;
    g->pci_function = fn;
    return 0;
}

static int read_nvlinks(struct cursor *c, struct nvmlDevice_st *g)
{
    g->nvlink_count = 0;
    if (peek(c) == 'n')
        return read_literal(c, "null");   /* null: no NVLink at all */
    if (++c->depth > FAKE_MAX_DEPTH || expect(c, '['))
        return -1;
    if (peek(c) == ']') {
        c->p++;
        c->depth--;
        return 0;
    }
    for (;;) {
        if (g->nvlink_count >= NVML_NVLINK_MAX_LINKS ||
            read_bool(c, &g->nvlink_active[g->nvlink_count]))
            return -1;
        g->nvlink_count++;
        if (peek(c) == ',') {
            c->p++;
            continue;
        }
        if (expect(c, ']'))
            return -1;
        c->depth--;
        return 0;
    }
}

/* [n, n, ...] of unsigned counters, one per link, into column `counter` */
static int read_link_counters(struct cursor *c, struct nvmlDevice_st *g, int counter)
{
    unsigned int link = 0;
    if (++c->depth > FAKE_MAX_DEPTH || expect(c, '['))
        return -1;
    if (peek(c) == ']') {
        c->p++;
        c->depth--;
        return 0;
    }
    for (;;) {
        if (link >= NVML_NVLINK_MAX_LINKS ||
            read_unsigned(c, ~0ULL, &g->nvlink_errors[link][counter]))
            return -1;
        link++;
        if (peek(c) == ',') {
            c->p++;
            continue;
        }
        if (expect(c, ']'))
            return -1;
        c->depth--;
        return 0;
    }
}

static const struct {
    const char *name;
    unsigned int bit;
} feature_names[] = {
    {"ecc", FAKE_NS_ECC},
    {"remapped_rows", FAKE_NS_REMAPPED_ROWS},
    {"retired_pages", FAKE_NS_RETIRED_PAGES},
    {"nvlink_errors", FAKE_NS_NVLINK_ERRORS},
    {"clock_reasons", FAKE_NS_CLOCK_REASONS},
};

/* ["ecc", ...]: an unknown feature name is malformed input */
static int read_not_supported(struct cursor *c, struct nvmlDevice_st *g)
{
    g->not_supported = 0;
    if (++c->depth > FAKE_MAX_DEPTH || expect(c, '['))
        return -1;
    if (peek(c) == ']') {
        c->p++;
        c->depth--;
        return 0;
    }
    for (;;) {
        char name[32];
        unsigned int bit = 0;
        if (read_string(c, name, sizeof name))
            return -1;
        for (size_t i = 0; i < sizeof feature_names / sizeof feature_names[0]; i++)
            if (!strcmp(name, feature_names[i].name))
                bit = feature_names[i].bit;
        if (!bit)
            return -1;
        g->not_supported |= bit;
        if (peek(c) == ',') {
            c->p++;
            continue;
        }
        if (expect(c, ']'))
            return -1;
        c->depth--;
        return 0;
    }
}

static const struct {
    const char *key;
    int counter;
} link_counter_keys[] = {
    {"nvlink_replay", NVML_NVLINK_ERROR_DL_REPLAY},
    {"nvlink_recovery", NVML_NVLINK_ERROR_DL_RECOVERY},
    {"nvlink_crc_flit", NVML_NVLINK_ERROR_DL_CRC_FLIT},
    {"nvlink_crc_data", NVML_NVLINK_ERROR_DL_CRC_DATA},
    {"nvlink_ecc_data", NVML_NVLINK_ERROR_DL_ECC_DATA},
};

static int gpu_member(struct cursor *c, const char *key, void *ctx)
{
    struct nvmlDevice_st *g = ctx;
    unsigned long long v;
    if (!strcmp(key, "index")) {
        if (read_unsigned(c, 0xFFFFFFFFu, &v))
            return -1;
        g->index = (unsigned int)v;
        return 0;
    }
    if (!strcmp(key, "uuid"))
        return read_string(c, g->uuid, sizeof g->uuid);
    if (!strcmp(key, "name"))
        return read_string(c, g->name, sizeof g->name);
    if (!strcmp(key, "pci_bus_id"))
        return read_string(c, g->bus_id_text, sizeof g->bus_id_text) || parse_bus_id(g);
    if (!strcmp(key, "temperature_c")) {
        if (read_unsigned(c, 0xFFFFFFFFu, &v))
            return -1;
        g->temperature_c = (unsigned int)v;
        return 0;
    }
    if (!strcmp(key, "ecc_volatile_uncorrected"))
        return read_unsigned(c, ~0ULL, &g->ecc_volatile_uncorrected);
    if (!strcmp(key, "ecc_aggregate_uncorrected"))
        return read_unsigned(c, ~0ULL, &g->ecc_aggregate_uncorrected);
    if (!strcmp(key, "throttle_reasons"))
        return read_unsigned(c, ~0ULL, &g->throttle_reasons);
    if (!strcmp(key, "retired_pages_pending"))
        return read_bool(c, &g->retired_pages_pending);
    if (!strcmp(key, "remapped_rows_pending"))
        return read_bool(c, &g->remapped_rows_pending);
    if (!strcmp(key, "remapped_rows_failure"))
        return read_bool(c, &g->remapped_rows_failure);
    if (!strcmp(key, "missing"))
        return read_bool(c, &g->missing);
    if (!strcmp(key, "nvlink_active"))
        return read_nvlinks(c, g);
    if (!strcmp(key, "ecc_volatile_corrected"))
        return read_unsigned(c, ~0ULL, &g->ecc_volatile_corrected);
    if (!strcmp(key, "ecc_aggregate_corrected"))
        return read_unsigned(c, ~0ULL, &g->ecc_aggregate_corrected);
    if (!strcmp(key, "remapped_rows_correctable")) {
        if (read_unsigned(c, 0xFFFFFFFFu, &v))
            return -1;
        g->remapped_rows_correctable = (unsigned int)v;
        return 0;
    }
    if (!strcmp(key, "remapped_rows_uncorrectable")) {
        if (read_unsigned(c, 0xFFFFFFFFu, &v))
            return -1;
        g->remapped_rows_uncorrectable = (unsigned int)v;
        return 0;
    }
    if (!strcmp(key, "retired_pages_sbe") || !strcmp(key, "retired_pages_dbe")) {
        int cause = key[14] == 's' ? NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
                                   : NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR;
        if (read_unsigned(c, 0xFFFFFFFFu, &v) || v > FAKE_MAX_RETIRED)
            return -1;
        g->retired_pages[cause] = (unsigned int)v;
        return 0;
    }
    for (size_t i = 0; i < sizeof link_counter_keys / sizeof link_counter_keys[0]; i++)
        if (!strcmp(key, link_counter_keys[i].key))
            return read_link_counters(c, g, link_counter_keys[i].counter);
    if (!strcmp(key, "not_supported"))
        return read_not_supported(c, g);
    return skip_value(c);
}

static int read_gpus(struct cursor *c, struct fake_state *s)
{
    if (++c->depth > FAKE_MAX_DEPTH || expect(c, '['))
        return -1;
    if (peek(c) == ']') {
        c->p++;
        c->depth--;
        return 0;
    }
    for (;;) {
        struct nvmlDevice_st *g;
        if (s->count >= FAKE_MAX_GPUS)
            return -1;
        g = &s->gpus[s->count];
        memset(g, 0, sizeof *g);
        g->index = s->count;
        if (read_object(c, gpu_member, g))
            return -1;
        s->count++;
        if (peek(c) == ',') {
            c->p++;
            continue;
        }
        if (expect(c, ']'))
            return -1;
        c->depth--;
        return 0;
    }
}

static const struct {
    const char *name;
    nvmlReturn_t code;
} error_names[] = {
    {"uninitialized", NVML_ERROR_UNINITIALIZED},
    {"invalid_argument", NVML_ERROR_INVALID_ARGUMENT},
    {"not_supported", NVML_ERROR_NOT_SUPPORTED},
    {"no_permission", NVML_ERROR_NO_PERMISSION},
    {"already_initialized", NVML_ERROR_ALREADY_INITIALIZED},
    {"not_found", NVML_ERROR_NOT_FOUND},
    {"insufficient_size", NVML_ERROR_INSUFFICIENT_SIZE},
    {"insufficient_power", NVML_ERROR_INSUFFICIENT_POWER},
    {"driver_not_loaded", NVML_ERROR_DRIVER_NOT_LOADED},
    {"timeout", NVML_ERROR_TIMEOUT},
    {"irq_issue", NVML_ERROR_IRQ_ISSUE},
    {"library_not_found", NVML_ERROR_LIBRARY_NOT_FOUND},
    {"function_not_found", NVML_ERROR_FUNCTION_NOT_FOUND},
    {"corrupted_inforom", NVML_ERROR_CORRUPTED_INFOROM},
    {"gpu_is_lost", NVML_ERROR_GPU_IS_LOST},
    {"reset_required", NVML_ERROR_RESET_REQUIRED},
    {"operating_system", NVML_ERROR_OPERATING_SYSTEM},
    {"lib_rm_version_mismatch", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"in_use", NVML_ERROR_IN_USE},
    {"memory", NVML_ERROR_MEMORY},
    {"no_data", NVML_ERROR_NO_DATA},
    {"insufficient_resources", NVML_ERROR_INSUFFICIENT_RESOURCES},
    {"unknown", NVML_ERROR_UNKNOWN},
};

static int top_member(struct cursor *c, const char *key, void *ctx)
{
    struct fake_state *s = ctx;
    if (!strcmp(key, "gpus"))
        return read_gpus(c, s);
    if (!strcmp(key, "nvml_error")) {
        char name[64];
        if (peek(c) == 'n')
            return read_literal(c, "null");   /* null: no injected failure */
        if (read_string(c, name, sizeof name))
            return -1;
        s->init_error = NVML_ERROR_UNKNOWN;
        for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; i++)
            if (!strcmp(name, error_names[i].name))
                s->init_error = error_names[i].code;
        if (name[0] == '\0' || !strcmp(name, "success"))
            s->init_error = NVML_SUCCESS;
        return 0;
    }
    return skip_value(c);   /* "node" and anything else we do not use */
}

/* Parse text[0..len) into *s: 0 or -1. */
static int parse_state(const char *text, size_t len, struct fake_state *s)
{
    struct cursor c = {text, text + len, 0};
    memset(s, 0, sizeof *s);
    if (peek(&c) != '{' || read_object(&c, top_member, s))
        return -1;
    skip_ws(&c);
    return c.p == c.end ? 0 : -1;
}

/* Read the state file into *s; the NVML result nvmlInit should give. */
static nvmlReturn_t load_state(struct fake_state *s)
{
    const char *path = getenv("RECOVERY_FAKE_NVML_STATE");
    FILE *fh;
    char *buf;
    size_t len;
    int bad;

    if (!path || !*path)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    fh = fopen(path, "rb");
    if (!fh)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    buf = malloc(FAKE_MAX_FILE + 1);
    if (!buf) {
        fclose(fh);
        return NVML_ERROR_MEMORY;
    }
    len = fread(buf, 1, FAKE_MAX_FILE + 1, fh);
    bad = ferror(fh) || len > FAKE_MAX_FILE;
    fclose(fh);
    if (!bad) {
        buf[len] = '\0';
        bad = memchr(buf, '\0', len) != NULL || parse_state(buf, len, s) != 0;
    }
    free(buf);
    if (bad)
        return NVML_ERROR_UNKNOWN;
    return s->init_error;
}

/* ------------------------------------------------------------------------ */
/* NVML entry points */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    static struct fake_state fresh;   /* big: keep it off the caller's stack */
    nvmlReturn_t ret = NVML_SUCCESS;
    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) {
        ret = load_state(&fresh);
        if (ret == NVML_SUCCESS)
            g_state = fresh;
    }
    if (ret == NVML_SUCCESS)
        g_refcount++;
    pthread_mutex_unlock(&g_lock);
    return ret;
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        ret = NVML_ERROR_UNINITIALIZED;
    else
        g_refcount--;
    pthread_mutex_unlock(&g_lock);
    return ret;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_text(const char *text, char *out, unsigned int length)
{
    size_t need = strlen(text) + 1;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (need > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, need);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    return copy_text(FAKE_DRIVER, version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = g_state.count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= g_state.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_state.gpus[index];
    return NVML_SUCCESS;
}

/* Common checks of a per-device call: initialized, a handle of ours, not lost. */
static nvmlReturn_t check_device(nvmlDevice_t device, const void *out)
{
    if (g_refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!out || device < g_state.gpus || device >= g_state.gpus + g_state.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->missing)
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlReturn_t ret = check_device(device, index);
    if (ret == NVML_SUCCESS)
        *index = device->index;
    return ret;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t ret = check_device(device, uuid);
    return ret == NVML_SUCCESS ? copy_text(device->uuid, uuid, length) : ret;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t ret = check_device(device, name);
    return ret == NVML_SUCCESS ? copy_text(device->name, name, length) : ret;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlReturn_t ret = check_device(device, pci);
    if (ret != NVML_SUCCESS)
        return ret;
    memset(pci, 0, sizeof *pci);
    pci->domain = device->pci_domain;
    pci->bus = device->pci_bus;
    pci->device = device->pci_device;
    pci->pciDeviceId = FAKE_PCI_DEVICE_ID;
    pci->pciSubSystemId = FAKE_PCI_SUBSYS_ID;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", device->pci_domain,
             device->pci_bus, device->pci_device, device->pci_function);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X",
             device->pci_domain & 0xFFFFu, device->pci_bus, device->pci_device,
             device->pci_function);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts)
{
    nvmlReturn_t ret = check_device(device, eccCounts);
    if (ret != NVML_SUCCESS)
        return ret;
    if ((errorType != NVML_MEMORY_ERROR_TYPE_CORRECTED &&
         errorType != NVML_MEMORY_ERROR_TYPE_UNCORRECTED) ||
        (counterType != NVML_VOLATILE_ECC && counterType != NVML_AGGREGATE_ECC))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->not_supported & FAKE_NS_ECC)
        return NVML_ERROR_NOT_SUPPORTED;
    if (errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED)
        *eccCounts = counterType == NVML_VOLATILE_ECC ? device->ecc_volatile_corrected
                                                      : device->ecc_aggregate_corrected;
    else if (counterType == NVML_VOLATILE_ECC)
        *eccCounts = device->ecc_volatile_uncorrected;
    else
        *eccCounts = device->ecc_aggregate_uncorrected;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                    nvmlEnableState_t *isPending)
{
    nvmlReturn_t ret = check_device(device, isPending);
    if (ret == NVML_SUCCESS && (device->not_supported & FAKE_NS_RETIRED_PAGES))
        return NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS)
        *isPending = device->retired_pages_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return ret;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred)
{
    nvmlReturn_t ret = check_device(device, corrRows);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!uncRows || !isPending || !failureOccurred)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->not_supported & FAKE_NS_REMAPPED_ROWS)
        return NVML_ERROR_NOT_SUPPORTED;
    *corrRows = device->remapped_rows_correctable;
    *uncRows = device->remapped_rows_uncorrectable;
    *isPending = device->remapped_rows_pending ? 1 : 0;
    *failureOccurred = device->remapped_rows_failure ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType,
                                      unsigned int *temp)
{
    nvmlReturn_t ret = check_device(device, temp);
    if (ret != NVML_SUCCESS)
        return ret;
    if (sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = device->temperature_c;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *clocksEventReasons)
{
    nvmlReturn_t ret = check_device(device, clocksEventReasons);
    if (ret == NVML_SUCCESS && (device->not_supported & FAKE_NS_CLOCK_REASONS))
        return NVML_ERROR_NOT_SUPPORTED;
    if (ret == NVML_SUCCESS)
        *clocksEventReasons = device->throttle_reasons;
    return ret;
}

/* the older name of the same call, still exported by real drivers */
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *clocksThrottleReasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, clocksThrottleReasons);
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                      nvmlEnableState_t *isActive)
{
    nvmlReturn_t ret = check_device(device, isActive);
    if (ret != NVML_SUCCESS)
        return ret;
    if (link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= device->nvlink_count)
        return NVML_ERROR_NOT_SUPPORTED;   /* this GPU has fewer links */
    *isActive = device->nvlink_active[link] ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

/* The page list of one cause: made-up page addresses, and for _v2 times. With
 * *pageCount == 0 (addresses may then be NULL) it only reports the count. */
static nvmlReturn_t retired_pages(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                  unsigned int *pageCount, unsigned long long *addresses,
                                  unsigned long long *timestamps)
{
    nvmlReturn_t ret = check_device(device, pageCount);
    unsigned int have, room;
    if (ret != NVML_SUCCESS)
        return ret;
    if ((int)cause < 0 || cause >= NVML_PAGE_RETIREMENT_CAUSE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->not_supported & FAKE_NS_RETIRED_PAGES)
        return NVML_ERROR_NOT_SUPPORTED;
    have = device->retired_pages[cause];
    room = *pageCount;
    *pageCount = have;
    if (room == 0)
        return have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    if (!addresses)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < have && i < room; i++) {
        addresses[i] = ((unsigned long long)(cause + 1) << 32) | ((unsigned long long)(i + 1) << 12);
        if (timestamps)
            timestamps[i] = 1700000000ULL + i;
    }
    return room < have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                       unsigned int *pageCount, unsigned long long *addresses)
{
    return retired_pages(device, cause, pageCount, addresses, NULL);
}

nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                          unsigned int *pageCount, unsigned long long *addresses,
                                          unsigned long long *timestamps)
{
    if (timestamps == NULL && pageCount && *pageCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    return retired_pages(device, cause, pageCount, addresses, timestamps);
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
                                             nvmlNvLinkErrorCounter_t counter,
                                             unsigned long long *counterValue)
{
    nvmlReturn_t ret = check_device(device, counterValue);
    if (ret != NVML_SUCCESS)
        return ret;
    if (link >= NVML_NVLINK_MAX_LINKS || (int)counter < 0 || counter >= NVML_NVLINK_ERROR_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= device->nvlink_count || (device->not_supported & FAKE_NS_NVLINK_ERRORS))
        return NVML_ERROR_NOT_SUPPORTED;
    *counterValue = device->nvlink_errors[link][counter];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t ret = check_device(device, memory);
    if (ret != NVML_SUCCESS)
        return ret;
    memory->total = FAKE_MEMORY_BYTES;
    memory->used = 0;
    memory->free = FAKE_MEMORY_BYTES;
    return NVML_SUCCESS;
}
