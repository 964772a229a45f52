/* ============================================================================
 * A small strict JSON reader (RFC 8259) for the safetensors header: a cursor over
 * the text that the caller drives (object, key, value ...), with checked helpers for
 * strings (escapes decoded, UTF-8 validated), non-negative integers (no fraction, no
 * exponent, no overflow) and a validating skip of any value with bounded nesting.
 * No allocation. On error a helper returns DTR_CORRUPT_FILE and leaves a short
 * description of the problem, with its byte offset, in j->msg; the caller adds the
 * file and field it was reading.
 * Private to the amalgamation (static, SQLite-style): src/io/safetensors.c, which follows
 * this file in the amalgamation's order, is its user.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

/* ---- cursor ---- */

/** Deepest nesting of arrays and objects that dtr__json_skip accepts. */
#define DTR__JSON_MAX_DEPTH 64

/** Reading state over a JSON text of `n` bytes (not NUL-terminated). */
typedef struct dtr__json {
    const char *s;    /* text */
    size_t n;         /* its length */
    size_t pos;       /* next byte to read */
    char msg[160];    /* the last problem found, with its byte offset */
} dtr__json;

/** Starts reading `n` bytes at `s`. */
static void dtr__json_init(dtr__json *j, const char *s, size_t n) {
    j->s = s;
    j->n = n;
    j->pos = 0;
    j->msg[0] = '\0';
}

/* Records a problem at the current position and returns DTR_CORRUPT_FILE. */
static dtr_result dtr__json_fail(dtr__json *j, const char *what) {
    if (j->pos < j->n) {
        unsigned char c = (unsigned char)j->s[j->pos];
        if (c >= 0x20 && c < 0x7f)
            snprintf(j->msg, sizeof j->msg, "%s at byte %llu (found '%c')", what,
                     (unsigned long long)j->pos, (char)c);
        else
            snprintf(j->msg, sizeof j->msg, "%s at byte %llu (found byte 0x%02x)", what,
                     (unsigned long long)j->pos, c);
    } else {
        snprintf(j->msg, sizeof j->msg, "%s at byte %llu (end of text)", what, (unsigned long long)j->pos);
    }
    return DTR_CORRUPT_FILE;
}

/** Skips JSON whitespace (space, tab, CR, LF). */
static void dtr__json_ws(dtr__json *j) {
    while (j->pos < j->n) {
        char c = j->s[j->pos];
        if (c != ' ' && c != '\t' && c != '\r' && c != '\n') break;
        j->pos++;
    }
}

/** Skips whitespace and returns the next byte (0..255), or -1 at the end of the text. */
static int dtr__json_peek(dtr__json *j) {
    dtr__json_ws(j);
    return j->pos < j->n ? (int)(unsigned char)j->s[j->pos] : -1;
}

/** Skips whitespace and consumes `c` when it comes next. Returns 1 if it did, else 0. */
static int dtr__json_accept(dtr__json *j, char c) {
    if (dtr__json_peek(j) == (int)(unsigned char)c) {
        j->pos++;
        return 1;
    }
    return 0;
}

/** Skips whitespace and consumes `c`, or fails with "expected 'c'". */
static dtr_result dtr__json_expect(dtr__json *j, char c) {
    char what[32];
    if (dtr__json_accept(j, c)) return DTR_OK;
    snprintf(what, sizeof what, "expected '%c'", c);
    return dtr__json_fail(j, what);
}

/** Succeeds when only whitespace is left (no trailing garbage). */
static dtr_result dtr__json_end(dtr__json *j) {
    dtr__json_ws(j);
    if (j->pos != j->n) return dtr__json_fail(j, "trailing characters after the JSON value");
    return DTR_OK;
}

/* ---- strings ---- */

static int dtr__json_hex4(const char *p, uint32_t *out) {
    uint32_t v = 0;
    int i;
    for (i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Length of the valid UTF-8 sequence starting at s[0] (at most n bytes), or 0 when it is
 * malformed (overlong, surrogate, above U+10FFFF, truncated). */
static size_t dtr__json_utf8_len(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        return (n >= 2 && (s[1] & 0xc0) == 0x80) ? 2 : 0;
    }
    if (c >= 0xe0 && c <= 0xef) {
        unsigned char lo = 0x80, hi = 0xbf;
        if (c == 0xe0) lo = 0xa0;         /* overlong */
        if (c == 0xed) hi = 0x9f;         /* surrogates */
        if (n < 3 || s[1] < lo || s[1] > hi || (s[2] & 0xc0) != 0x80) return 0;
        return 3;
    }
    if (c >= 0xf0 && c <= 0xf4) {
        unsigned char lo = 0x80, hi = 0xbf;
        if (c == 0xf0) lo = 0x90;         /* overlong */
        if (c == 0xf4) hi = 0x8f;         /* above U+10FFFF */
        if (n < 4 || s[1] < lo || s[1] > hi || (s[2] & 0xc0) != 0x80 || (s[3] & 0xc0) != 0x80) return 0;
        return 4;
    }
    return 0;
}

/* Appends code point `cp` as UTF-8 to buf (capacity cap, keeping room for the NUL) while
 * it fits; *len counts every byte, stored or not. */
static void dtr__json_put(char *buf, size_t cap, size_t *len, const char *bytes, size_t nb) {
    size_t i;
    for (i = 0; i < nb; i++) {
        if (buf && *len + 1 < cap) buf[*len] = bytes[i];
        (*len)++;
    }
}

static void dtr__json_put_cp(char *buf, size_t cap, size_t *len, uint32_t cp) {
    char b[4];
    size_t nb;
    if (cp < 0x80) { b[0] = (char)cp; nb = 1; }
    else if (cp < 0x800) { b[0] = (char)(0xc0 | (cp >> 6)); b[1] = (char)(0x80 | (cp & 0x3f)); nb = 2; }
    else if (cp < 0x10000) {
        b[0] = (char)(0xe0 | (cp >> 12)); b[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        b[2] = (char)(0x80 | (cp & 0x3f)); nb = 3;
    } else {
        b[0] = (char)(0xf0 | (cp >> 18)); b[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        b[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); b[3] = (char)(0x80 | (cp & 0x3f)); nb = 4;
    }
    dtr__json_put(buf, cap, len, b, nb);
}

/** Reads a string value (after optional whitespace). Escapes are decoded and the text is
 *  checked to be valid UTF-8 without control characters or lone surrogates.
 *  @param buf  receives the decoded bytes, NUL-terminated and cut to cap-1 bytes (may be
 *              NULL with cap 0 to validate and skip).
 *  @param len  receives the full decoded length, also when it did not fit: the caller
 *              compares it with cap to reject long strings (may be NULL).
 *  A "\u0000" escape decodes to a NUL byte; callers that need C strings compare strlen. */
static dtr_result dtr__json_string(dtr__json *j, char *buf, size_t cap, size_t *len) {
    size_t n = 0;
    if (buf && cap) buf[0] = '\0';
    if (len) *len = 0;
    if (dtr__json_peek(j) != '"') return dtr__json_fail(j, "expected a string");
    j->pos++;
    for (;;) {
        unsigned char c;
        if (j->pos >= j->n) return dtr__json_fail(j, "unterminated string");
        c = (unsigned char)j->s[j->pos];
        if (c == '"') { j->pos++; break; }
        if (c < 0x20) return dtr__json_fail(j, "control character in string");
        if (c == '\\') {
            char e;
            if (j->pos + 1 >= j->n) { j->pos++; return dtr__json_fail(j, "unterminated escape"); }
            e = j->s[j->pos + 1];
            switch (e) {
            case '"': dtr__json_put(buf, cap, &n, "\"", 1); j->pos += 2; break;
            case '\\': dtr__json_put(buf, cap, &n, "\\", 1); j->pos += 2; break;
            case '/': dtr__json_put(buf, cap, &n, "/", 1); j->pos += 2; break;
            case 'b': dtr__json_put(buf, cap, &n, "\b", 1); j->pos += 2; break;
            case 'f': dtr__json_put(buf, cap, &n, "\f", 1); j->pos += 2; break;
            case 'n': dtr__json_put(buf, cap, &n, "\n", 1); j->pos += 2; break;
            case 'r': dtr__json_put(buf, cap, &n, "\r", 1); j->pos += 2; break;
            case 't': dtr__json_put(buf, cap, &n, "\t", 1); j->pos += 2; break;
            case 'u': {
                uint32_t cp, lo;
                if (j->n - j->pos < 6 || !dtr__json_hex4(j->s + j->pos + 2, &cp))
                    return dtr__json_fail(j, "bad \\u escape in string");
                if (cp >= 0xdc00 && cp <= 0xdfff) return dtr__json_fail(j, "lone low surrogate escape in string");
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    if (j->n - j->pos < 12 || j->s[j->pos + 6] != '\\' || j->s[j->pos + 7] != 'u' ||
                        !dtr__json_hex4(j->s + j->pos + 8, &lo) || lo < 0xdc00 || lo > 0xdfff)
                        return dtr__json_fail(j, "high surrogate escape not followed by a low surrogate");
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    j->pos += 6;
                }
                dtr__json_put_cp(buf, cap, &n, cp);
                j->pos += 6;
                break;
            }
            default:
                return dtr__json_fail(j, "bad escape in string");
            }
        } else {
            size_t k = dtr__json_utf8_len((const unsigned char *)j->s + j->pos, j->n - j->pos);
            if (k == 0) return dtr__json_fail(j, "invalid UTF-8 in string");
            dtr__json_put(buf, cap, &n, j->s + j->pos, k);
            j->pos += k;
        }
    }
    if (buf && cap) buf[n < cap ? n : cap - 1] = '\0';
    if (len) *len = n;
    return DTR_OK;
}

/* ---- numbers ---- */

/** Reads a non-negative integer that fits in 64 bits: digits only, no sign, no leading
 *  zero, no fraction, no exponent. Each violation has its own message. */
static dtr_result dtr__json_u64(dtr__json *j, uint64_t *out) {
    uint64_t v = 0;
    size_t start;
    int c = dtr__json_peek(j);
    *out = 0;
    if (c == '-') return dtr__json_fail(j, "negative number where a non-negative integer is required");
    if (c < '0' || c > '9') return dtr__json_fail(j, "expected a non-negative integer");
    start = j->pos;
    while (j->pos < j->n && j->s[j->pos] >= '0' && j->s[j->pos] <= '9') {
        unsigned d = (unsigned)(j->s[j->pos] - '0');
        if (v > (UINT64_MAX - d) / 10) {
            j->pos = start;
            return dtr__json_fail(j, "integer overflows 64 bits");
        }
        v = v * 10 + d;
        j->pos++;
    }
    if (j->s[start] == '0' && j->pos - start > 1) {
        j->pos = start;
        return dtr__json_fail(j, "number with a leading zero");
    }
    if (j->pos < j->n && (j->s[j->pos] == '.' || j->s[j->pos] == 'e' || j->s[j->pos] == 'E'))
        return dtr__json_fail(j, "number with a fraction or exponent where an integer is required");
    *out = v;
    return DTR_OK;
}

/* Skips a JSON number (full grammar: -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?). */
static dtr_result dtr__json_number(dtr__json *j) {
    size_t p = j->pos;
    const char *s = j->s;
    size_t n = j->n;
    if (p < n && s[p] == '-') p++;
    if (p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return dtr__json_fail(j, "bad number"); }
    if (s[p] == '0') p++;
    else while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    if (p < n && s[p] == '.') {
        p++;
        if (p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return dtr__json_fail(j, "bad number fraction"); }
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    if (p < n && (s[p] == 'e' || s[p] == 'E')) {
        p++;
        if (p < n && (s[p] == '+' || s[p] == '-')) p++;
        if (p >= n || s[p] < '0' || s[p] > '9') { j->pos = p; return dtr__json_fail(j, "bad number exponent"); }
        while (p < n && s[p] >= '0' && s[p] <= '9') p++;
    }
    j->pos = p;
    return DTR_OK;
}

/* ---- any value ---- */

static int dtr__json_word(dtr__json *j, const char *w) {
    size_t k = strlen(w);
    if (j->n - j->pos >= k && memcmp(j->s + j->pos, w, k) == 0) {
        j->pos += k;
        return 1;
    }
    return 0;
}

static dtr_result dtr__json_skip_depth(dtr__json *j, int depth) {
    dtr_result r;
    int c = dtr__json_peek(j);
    switch (c) {
    case '{':
        if (depth >= DTR__JSON_MAX_DEPTH) return dtr__json_fail(j, "JSON nested too deeply (more than 64 levels)");
        j->pos++;
        if (dtr__json_accept(j, '}')) return DTR_OK;
        for (;;) {
            if ((r = dtr__json_string(j, NULL, 0, NULL)) != DTR_OK) return r;
            if ((r = dtr__json_expect(j, ':')) != DTR_OK) return r;
            if ((r = dtr__json_skip_depth(j, depth + 1)) != DTR_OK) return r;
            if (dtr__json_accept(j, ',')) continue;
            return dtr__json_expect(j, '}');
        }
    case '[':
        if (depth >= DTR__JSON_MAX_DEPTH) return dtr__json_fail(j, "JSON nested too deeply (more than 64 levels)");
        j->pos++;
        if (dtr__json_accept(j, ']')) return DTR_OK;
        for (;;) {
            if ((r = dtr__json_skip_depth(j, depth + 1)) != DTR_OK) return r;
            if (dtr__json_accept(j, ',')) continue;
            return dtr__json_expect(j, ']');
        }
    case '"':
        return dtr__json_string(j, NULL, 0, NULL);
    case 't':
        if (dtr__json_word(j, "true")) return DTR_OK;
        break;
    case 'f':
        if (dtr__json_word(j, "false")) return DTR_OK;
        break;
    case 'n':
        if (dtr__json_word(j, "null")) return DTR_OK;
        break;
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return dtr__json_number(j);
        break;
    }
    return dtr__json_fail(j, "expected a JSON value");
}

/** Validates and skips one value of any kind, nested at most DTR__JSON_MAX_DEPTH deep. */
static dtr_result dtr__json_skip(dtr__json *j) {
    return dtr__json_skip_depth(j, 0);
}

/** Checks that the whole text is exactly one valid JSON value (whitespace around it is
 *  allowed); the caller then walks it knowing the syntax is sound. */
static dtr_result dtr__json_validate(dtr__json *j) {
    dtr_result r;
    j->pos = 0;
    if ((r = dtr__json_skip(j)) != DTR_OK) return r;
    if ((r = dtr__json_end(j)) != DTR_OK) return r;
    j->pos = 0;
    return DTR_OK;
}
