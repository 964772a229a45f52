/* ============================================================================
 * The parameter servers' wire format (src/engine/ps.c), private: a fixed header, then the
 * payload. dtr__ps_parse validates a message a server received; the fuzz target
 * tests/fuzz/fuzz_ps.c feeds it arbitrary bytes.
 * ==========================================================================*/

#define DTR__PS_MAGIC 0x53505444u   /* "DTPS" */
#define DTR__PS_VERSION 1

/** Message kinds (worker -> server: PUSH, PULL, DONE, PUSH_ROWS, PULL_ROWS; server -> worker:
 *  REPLY, ACK (replicas: a PUSH or DONE is held by the server and its backup); primary ->
 *  backup: the workers' messages as they came, and DROP (worker `worker` left the rounds)).
 *  The ROWS kinds carry `begin` segments (int64 offset, int64 length: floats of the server's
 *  range) before their values; `count` is the sum of the lengths. */
enum { DTR__PS_PUSH = 1, DTR__PS_PULL = 2, DTR__PS_DONE = 3, DTR__PS_REPLY = 4, DTR__PS_PUSH_ROWS = 5, DTR__PS_PULL_ROWS = 6,
       DTR__PS_ACK = 7, DTR__PS_DROP = 8 };
#define DTR__PS_MAX_SEGMENTS (1 << 24)

/** PUSH's dtype for push_compress INT8 (not a dtr_dtype): the range in blocks of
 *  DTR__PS_INT8_BLOCK floats, each [f32 scale][block int8] (the last block shorter). */
#define DTR__PS_INT8 100
#define DTR__PS_INT8_BLOCK 4096

/** The header of every message (host byte order: the ranks of a group share one ABI). A
 *  message is the header, `count` values of `dtype`, then the 8-byte trailer
 *  dtr__ps_trailer(header): receives do not report their length, so a server zeroes the
 *  header and trailer of its buffer after each message and a shorter message than its header
 *  claims is caught by the trailer missing. */
typedef struct dtr__ps_hdr {
    uint32_t magic;
    uint16_t version, kind;
    int32_t worker;     /**< the sender's worker index (REPLY: the server's index) */
    int32_t dtype;      /**< PUSH: the payload's dtype (f32, bf16, f16 or DTR__PS_INT8); PUSH_ROWS: f32 or bf16; else 0 */
    int64_t clock;      /**< PUSH: the worker's clock; PULL: the clock wanted; REPLY: the server's clock */
    int64_t begin;      /**< the range's first float (the server's) */
    int64_t count;      /**< floats of payload (PUSH, REPLY), 0 otherwise */
} dtr__ps_hdr;

/** What a server expects: its index, range and the number of workers. */
typedef struct dtr__ps_expect {
    int server, workers;
    int64_t begin, count;
} dtr__ps_expect;

/** The trailer that ends a message with header h. */
DTR__PRIVATE uint64_t dtr__ps_trailer(const dtr__ps_hdr *h);
/** Bytes of the message header h announces (header, payload, trailer); 0 when h's kind,
 *  dtype or count make no sense. */
DTR__PRIVATE size_t dtr__ps_message_bytes(const dtr__ps_hdr *h);

/** Validates the message from worker `from` in a receive buffer of `cap` bytes, for the
 *  server `e` describes. On DTR_OK *h holds the header and the payload (h->count elements of
 *  h->dtype) follows it in buf.
 *  @return DTR_OK or DTR_CORRUPT_FILE with `why` (may be NULL) saying what is wrong. */
DTR__PRIVATE dtr_result dtr__ps_parse(const void *buf, size_t len, int from, const dtr__ps_expect *e, dtr__ps_hdr *h,
                                      char *why, size_t whylen);

/** The engine's own group (a split of the application's): tests send crafted messages on it
 *  (tag DTR__PS_TAG_REQ). */
dtr_comm *dtr__ps_group(dtr_ps *ps);
#define DTR__PS_TAG_REQ ((1 << 29) + 1)
#define DTR__PS_TAG_REP ((1 << 29) + 2)
#define DTR__PS_TAG_REPL ((1 << 29) + 3)       /* primary -> backup: forwarded messages */
#define DTR__PS_TAG_REPL_ACK ((1 << 29) + 4)   /* backup -> primary: held */
