/* tests/header_only/syntax.c: compile check of dtrain.h (`make header-check`).
 * Compiled with -fsyntax-only as pedantic C99 and as C++, each without and with
 * -DDTRAIN_IMPLEMENTATION. The header is included twice to check its include guards. */
#include "../../dtrain.h"
#include "../../dtrain.h"

int dtrain_header_check(void);
int dtrain_header_check(void) {
    dtr_context_config cfg = dtr_context_config_init();
    return (int)sizeof(cfg) + dtr_version() + (int)DTR_MAX_DIMS;
}
