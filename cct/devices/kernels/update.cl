// The solver's update on the device (cct.training.updates' six rules): one
// work item per parameter element, each operation of the host's numpy passes
// in their order, every product and quotient rounded to float before the next
// operation (no fused multiply-add), so the numbers are the host's bit for bit
// where sqrt and division are correctly rounded (built with
// -cl-fp32-correctly-rounded-divide-sqrt). Scalars come as the host's float32
// casts of its double values.
#pragma OPENCL FP_CONTRACT OFF

#define STEP_ARGS const int count, global float* data, global float* diff, global float* h1, \
                  global float* h2, const float clip, const float normalize, const int regularization, \
                  const float decay, const float rate, const float c0, const float c1, const float c2, \
                  const float c3, const float c4

// numpy's sign: -1, 0 (for either zero), 1, NaN kept
float signum(float x) {
    return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x));
}

// The gradient clip_gradients, normalize and regularize leave in diff (a
// scale of exactly 1 where the host skips the pass; regularization 0 none,
// 1 L2, 2 L1)
float gradient(global const float* data, global const float* diff, int i, float clip, float normalize,
               int regularization, float decay) {
    float g = diff[i] * clip;
    g = g * normalize;
    if (regularization == 1) {
        float t = data[i] * decay;
        g = g + t;
    } else if (regularization == 2) {
        float t = signum(data[i]) * decay;
        g = g + t;
    }
    return g;
}

// Blob::Update, with the step left in diff as the host leaves it
void apply(global float* data, global float* diff, int i, float step) {
    diff[i] = step;
    data[i] = data[i] - step;
}

// c0 momentum
kernel void update_sgd(STEP_ARGS) {
    int i = get_global_id(0);
    if (i >= count) return;
    float g = gradient(data, diff, i, clip, normalize, regularization, decay);
    float h = h1[i] * c0;
    float t = g * rate;
    h = h + t;
    h1[i] = h;
    apply(data, diff, i, h);
}

// c0 momentum, c1 1 + momentum
kernel void update_nesterov(STEP_ARGS) {
    int i = get_global_id(0);
    if (i >= count) return;
    float g = gradient(data, diff, i, clip, normalize, regularization, decay);
    float previous = h1[i];
    float h = previous * c0;
    float t = rate * g;
    h = h + t;
    h1[i] = h;
    float step = h * c1;
    previous = previous * c0;
    apply(data, diff, i, step - previous);
}

// diff / (sqrt(history) + delta) * rate, AdaGrad's and RMSProp's step
float divided_by_root(float g, float history, float delta, float rate) {
    float root = sqrt(history);
    root = root + delta;
    float step = g / root;
    return step * rate;
}

// c0 delta
kernel void update_adagrad(STEP_ARGS) {
    int i = get_global_id(0);
    if (i >= count) return;
    float g = gradient(data, diff, i, clip, normalize, regularization, decay);
    float square = g * g;
    float h = h1[i] + square;
    h1[i] = h;
    apply(data, diff, i, divided_by_root(g, h, c0, rate));
}

// c0 rms_decay, c1 1 - rms_decay, c2 delta
kernel void update_rmsprop(STEP_ARGS) {
    int i = get_global_id(0);
    if (i >= count) return;
    float g = gradient(data, diff, i, clip, normalize, regularization, decay);
    float square = g * g;
    square = square * c1;
    float h = h1[i] * c0;
    h = h + square;
    h1[i] = h;
    apply(data, diff, i, divided_by_root(g, h, c2, rate));
}

// c0 momentum, c1 1 - momentum, c2 delta; h1 the squared gradients' average, h2 the squared steps'
kernel void update_adadelta(STEP_ARGS) {
    int i = get_global_id(0);
    if (i >= count) return;
    float g = gradient(data, diff, i, clip, normalize, regularization, decay);
    float square = g * g;
    square = c1 * square;
    float gradients = h1[i] * c0;
    gradients = gradients + square;
    h1[i] = gradients;
    float ratio = h2[i] + c2;
    float below = gradients + c2;
    ratio = ratio / below;
    ratio = sqrt(ratio);
    float step = g * ratio;
    float step_square = step * step;
    step_square = c1 * step_square;
    float updates = h2[i] * c0;
    h2[i] = updates + step_square;
    apply(data, diff, i, step * rate);
}

// c0 beta1, c1 1 - beta1, c2 beta2, c3 1 - beta2, c4 delta; rate the local
// rate times the bias correction; h1 the first moment, h2 the second
kernel void update_adam(STEP_ARGS) {
    int i = get_global_id(0);
    if (i >= count) return;
    float g = gradient(data, diff, i, clip, normalize, regularization, decay);
    float first = h1[i] * c0;
    float t = c1 * g;
    first = first + t;
    h1[i] = first;
    float square = g * g;
    square = c3 * square;
    float second = h2[i] * c2;
    second = second + square;
    h2[i] = second;
    float root = sqrt(second);
    root = root + c4;
    float step = first / root;
    apply(data, diff, i, step * rate);
}

// partial[i] (+)= the sum of x[j]^2 over j = i, i + parts, i + 2 parts, ...
// (clip_gradients' norm: every parameter's squares into the same parts, then
// one sum over them and one scalar read)
kernel void sum_squares(const int count, global const float* x, const int parts, global float* partial,
                        const int accumulate) {
    int i = get_global_id(0);
    if (i >= parts) return;
    float sum = 0.0f;
    for (int j = i; j < count; j += parts) {
        float square = x[j] * x[j];
        sum = sum + square;
    }
    partial[i] = accumulate ? partial[i] + sum : sum;
}
