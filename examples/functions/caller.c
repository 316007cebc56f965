/* caller: invokes the function "echo" with its input and prints the result. */
#include <stdio.h>
#include <stdlib.h>

#include "meshgate.h"

int main(void) {
  static char in[1 << 20];
  static const char name[] = "echo";
  size_t n = fread(in, 1, sizeof in, stdin);
  uint32_t cap = 4096;
  char *out = malloc(cap);
  int64_t len = mg_invoke(name, sizeof name - 1, in, (uint32_t)n, out, cap);
  if (len > (int64_t)cap) {
    /* Too small: the length came back, call again with a buffer that big. */
    cap = (uint32_t)len;
    out = realloc(out, cap);
    len = mg_invoke(name, sizeof name - 1, in, (uint32_t)n, out, cap);
  }
  if (len < 0) {
    fprintf(stderr, "invoke failed: %lld\n", (long long)len);
    return 1;
  }
  fwrite(out, 1, (size_t)len, stdout);
  return 0;
}
